"""Python binding for dsv4 (ctypes over libdsv4).

    import dsv4
    dsv4.version()                       # "0.1.0"
    dsv4.default_params()                # dict: every key, see docs/params.md
    dsv4.validate_params({...})          # dict: the resolved document, sizes in bytes
    dsv4.plan({"model_path": "configs/deepseek-v4-flash", ...})        # dict
    print(dsv4.plan_text({...}))         # the same plan as a table

    with dsv4.Engine({"model_path": "/models/DeepSeek-V4-Flash"}) as engine:
        logits = engine.score([0, 1234, 5678])   # numpy float32 [3, vocab]
        engine.model_info()                      # dict
        tokens = engine.generate([0, 1234], max_new_tokens=32, temperature=0)
        for event in engine.stream([0, 1234], max_new_tokens=32, top_p=0.9, seed=7):
            ...                                  # dsv4.Event: TOKEN events, then FINISHED
        rid = engine.submit([0, 1234], user_tag=5)   # raises dsv4.QueueFull when refused
        engine.poll(timeout_s=1.0)               # events of submit()-ed requests

    # Prefill/decode disaggregation (role = "prefill" / "decode", the "pd" params; the same
    # request, with the same pd_room, goes to both engines):
    #   endpoint = prefill.pd_endpoint()         # "tcp://host:port"; InvalidArgument if unified
    #   prefill.submit(prompt, pd_room=7)
    #   decode.generate(prompt, pd_room=7, pd_peer=endpoint)    # the tokens
    #   the prefill request ends FINISHED with FinishReason.TRANSFERRED once decode has its KV;
    #   a failed transfer ends a request with an ERROR event (generate(): KVTransferError, or
    #   Timeout for a PD deadline)

Failures raise a subclass of dsv4.Error carrying `.status` and `.message`. A value that its C
type cannot hold (a token id beyond int32_t, a negative count, a NUL inside a string, ...) is
refused before the call with dsv4.InvalidArgument (also a ValueError), a value of the wrong kind
(a float or bool where an integer is expected) with TypeError; nothing is truncated.

The library is found through DSV4_LIBRARY, next to this package, or in a source checkout's
target/release.
"""

import ctypes
import json
import queue

from . import _cvalues, _native
from .requests import (Event, EventKind, EngineState, FinishReason, Router, ShutdownMode,
                       build_request, finish_reason_name)
from .errors import (  # noqa: F401  (re-exported)
    Aborted,
    BufferTooSmall,
    CapacityError,
    ConfigError,
    Error,
    FileError,
    InternalError,
    InvalidArgument,
    KVTransferError,
    ModelFormatError,
    NotFound,
    QueueFull,
    ShutDown,
    Timeout,
    Unsupported,
    from_status,
)

__all__ = [
    "Engine",
    "Event",
    "EventKind",
    "EngineState",
    "FinishReason",
    "finish_reason_name",
    "ShutdownMode",
    "version",
    "default_params",
    "validate_params",
    "plan",
    "plan_text",
    "status_name",
    "Error",
    "InvalidArgument",
    "ConfigError",
    "FileError",
    "ModelFormatError",
    "CapacityError",
    "QueueFull",
    "Timeout",
    "Aborted",
    "KVTransferError",
    "BufferTooSmall",
    "Unsupported",
    "ShutDown",
    "NotFound",
    "InternalError",
]

_lib = _native.lib


def _check(status):
    if status != 0:
        raise from_status(status, _lib.dsv4_last_error().decode("utf-8", "replace"))


def _read_text(call):
    """Runs a (buf, cap, needed) C function until its output fits; returns the text."""
    needed = ctypes.c_size_t(0)
    _check(call(None, 0, ctypes.byref(needed)))
    for _ in range(8):
        buf = ctypes.create_string_buffer(needed.value)
        status = call(buf, needed.value, ctypes.byref(needed))
        if status == BufferTooSmall.status:
            continue  # reports with live readings can grow between calls
        _check(status)
        return buf.value.decode("utf-8")
    raise InternalError("the output kept growing between calls", InternalError.status)


def _params_bytes(params):
    """The params as the NUL-terminated JSON text the C API takes (a dict is serialised; JSON text
    with a NUL in it is refused rather than cut short)."""
    if not isinstance(params, (str, bytes, bytearray)):
        params = json.dumps(params)
    return _cvalues.value("params", params, ctypes.c_char_p)


def version():
    """The library's version, "MAJOR.MINOR.PATCH"."""
    return _lib.dsv4_version().decode("ascii")


def status_name(status):
    """The name of a status code, e.g. "DSV4_ERR_CONFIG"."""
    return _lib.dsv4_status_name(_cvalues.value("status", status, ctypes.c_int32)).decode("ascii")


def default_params():
    """The full default params document."""
    return json.loads(_read_text(_lib.dsv4_params_default))


def validate_params(params):
    """Validates params (a dict or JSON text) and returns the resolved document."""
    raw = _params_bytes(params)
    return json.loads(_read_text(lambda b, c, n: _lib.dsv4_params_validate(raw, b, c, n)))


def plan(params):
    """The per-rank memory plan for params (a dict or JSON text), as a dict."""
    raw = _params_bytes(params)
    return json.loads(_read_text(lambda b, c, n: _lib.dsv4_plan(raw, b, c, n)))


def plan_text(params):
    """The same plan as an aligned table."""
    raw = _params_bytes(params)
    return _read_text(lambda b, c, n: _lib.dsv4_plan_text(raw, b, c, n))


class Engine:
    """A loaded dsv4 engine. Use as a context manager, or call close() when done.

    Methods may be called from several threads at once; close() must not race with them.
    One internal thread polls the library and routes each event to the generate()/stream()
    call waiting for it, or to the queue read by poll() for requests made with submit().
    """

    def __init__(self, params):
        raw = _params_bytes(params)
        handle = ctypes.c_void_p()
        _check(_lib.dsv4_engine_create(raw, ctypes.byref(handle)))
        self._handle = handle
        self._router = Router(handle)
        self._vocab = self.model_info()["vocab_size"]

    def close(self):
        """Aborts what is in flight and frees the engine (idempotent)."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            # The library's threads end first (every request gets its terminal event), then
            # the poller, then the handle.
            _lib.dsv4_engine_shutdown(handle, ShutdownMode.ABORT, -1)
            self._router.close()
            _lib.dsv4_engine_destroy(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def _live(self):
        if not self._handle:
            raise InvalidArgument("the engine is closed", InvalidArgument.status)
        return self._handle

    def model_info(self):
        """Configuration summary, parameter count and resident bytes by dtype, and what a server
        needs: vocab_size, bos_token_id, eos_token_ids, context_limit, has_tokenizer,
        has_chat_template (see dsv4_model_info)."""
        handle = self._live()
        return json.loads(_read_text(lambda b, c, n: _lib.dsv4_model_info(handle, b, c, n)))

    def state(self):
        """(EngineState, reason): where the engine stands, e.g. (READY, "ready: 0 requests in
        flight") or (DRAINING, "shutting down (drain): 3 requests still running"). Works on a
        shut-down or failed engine; never blocks."""
        handle = self._live()
        state = ctypes.c_int32(-1)
        reason = _read_text(
            lambda b, c, n: _lib.dsv4_engine_state(handle, ctypes.byref(state), b, c, n))
        return EngineState(state.value), reason

    def params_resolved(self):
        """The params this engine runs with, every default filled in (a dict that
        validate_params and Engine() accept and resolve to the same params)."""
        handle = self._live()
        return json.loads(_read_text(lambda b, c, n: _lib.dsv4_params_resolved(handle, b, c, n)))

    def pd_endpoint(self):
        """The address PD peers reach this engine at, "tcp://host:port" (`pd.advertise`, else
        the address `pd.listen` bound): a prefill engine's endpoint is what decode requests
        pass as `pd_peer`. InvalidArgument in the unified role, which has none."""
        handle = self._live()
        return _read_text(lambda b, c, n: _lib.dsv4_pd_endpoint(handle, b, c, n))

    def score(self, tokens):
        """Logits of every position of one fresh sequence: numpy float32 [len(tokens), vocab]."""
        import numpy as np

        handle = self._live()
        ids = _cvalues.array("tokens", tokens, ctypes.c_int32)
        out = np.empty((len(ids), self._vocab), dtype=np.float32)
        _check(_lib.dsv4_score(
            handle,
            ids,
            len(ids),
            out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            out.size,
        ))
        return out

    # --- requests ---------------------------------------------------------------------------

    def submit(self, prompt, **fields):
        """Submits a request; returns its id. Keyword fields are struct dsv4_request's
        (max_new_tokens, stop_tokens, temperature, top_k, top_p, min_p, seed,
        logit_bias_tokens, logit_bias_values, priority, deadline_ms, cache_salt, user_tag,
        logprobs, pd_room, pd_peer); generate() and stream() take the same. pd_room (default 0)
        and pd_peer (default None; a prefill engine's pd_endpoint()) are for PD engines: a
        unified engine refuses them with InvalidArgument. Raises QueueFull, CapacityError,
        InvalidArgument or ShutDown when refused. Its events come from poll()."""
        self._live()
        req, keep = build_request(prompt, fields)
        rid, _ = self._router.submit(req, private=False)
        del keep
        return rid

    def poll(self, timeout_s=0.0):
        """Events of requests made with submit(): waits up to timeout_s (None: forever) for
        the first, then returns every one already there."""
        self._live()
        out = []
        try:
            out.append(self._router.general.get(timeout=timeout_s) if timeout_s != 0
                       else self._router.general.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._router.general.get_nowait())
            except queue.Empty:
                return out

    def abort(self, request_id):
        """Ends a request (FINISHED / ABORTED); NotFound if it is unknown or already ended."""
        rid = _cvalues.value("request_id", request_id, ctypes.c_uint64)
        _check(_lib.dsv4_abort(self._live(), rid))

    def stream(self, prompt, **fields):
        """Submits and yields the request's events: TOKEN events, then the terminal one.
        Closing the iterator early aborts the request and waits for it to end."""
        self._live()
        req, keep = build_request(prompt, fields)
        rid, q = self._router.submit(req, private=True)
        del keep
        done = False
        try:
            while True:
                event = q.get()
                done = event.terminal
                yield event
                if done:
                    return
        finally:
            if not done and self._handle:
                try:
                    self.abort(rid)
                except NotFound:
                    pass
                # Return once the request has ended (its pages are back in the pools).
                while not q.get(timeout=60).terminal:
                    pass

    def generate(self, prompt, **fields):
        """The generated tokens (blocking). An ERROR event raises the matching dsv4.Error."""
        tokens = []
        for event in self.stream(prompt, **fields):
            if event.kind == EventKind.TOKEN:
                tokens.append(event.token)
            elif event.kind == EventKind.ERROR:
                raise from_status(event.status, "request {} failed: {}".format(
                    event.request_id, event.message or status_name(event.status)))
        return tokens

    def cache_stats(self):
        """The prefix cache per pool and tier (used / total units and bytes) and its counters
        (hits by tier, load-backs, backups, evictions): a dict, see docs/hicache.md."""
        handle = self._live()
        return json.loads(_read_text(lambda b, c, n: _lib.dsv4_cache_stats(handle, b, c, n)))

    def metrics(self):
        """Counters (totals since creation), latency sums/counts and gauges as a flat dict
        (struct dsv4_metrics; pool units as nested dicts). Cheap: never waits for a step."""
        m = _native.Metrics()
        m.struct_size = ctypes.sizeof(m)
        _check(_lib.dsv4_metrics_get(self._live(), ctypes.byref(m)))
        if m.struct_size != ctypes.sizeof(m):
            raise InternalError("dsv4_metrics layout mismatch: the library filled {} bytes, this "
                                "binding expects {}: reinstall matching versions".format(
                                    m.struct_size, ctypes.sizeof(m)))
        out = {}
        for name, kind in m._fields_[1:]:
            value = getattr(m, name)
            if kind is _native.Units:
                value = {k: getattr(value, k) for k, _ in _native.Units._fields_}
            out[name] = value
        return out

    def prometheus(self):
        """The metrics in the Prometheus text format (serve as text/plain; version=0.0.4)."""
        handle = self._live()
        return _read_text(lambda b, c, n: _lib.dsv4_metrics_prometheus(handle, b, c, n))

    def cache_flush(self, tier="all"):
        """Drops every unlocked cached prefix from "device" (host copies stay), "host" or
        "all"."""
        _check(_lib.dsv4_cache_flush(self._live(), _cvalues.value("tier", tier, ctypes.c_char_p)))

    def shutdown(self, mode=ShutdownMode.DRAIN, timeout_s=None):
        """Stops intake; DRAIN lets accepted requests finish, ABORT ends them. Waits up to
        timeout_s (None: as long as it takes, else 0 to 2147483.647); raises Timeout if still
        draining."""
        mode = _cvalues.value("mode", mode, ctypes.c_int32)
        ms = _cvalues.timeout_ms("timeout_s", timeout_s)
        _check(_lib.dsv4_engine_shutdown(self._live(), mode, ms))


