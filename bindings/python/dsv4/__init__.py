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
        out = engine.generate([0, 1234], max_new_tokens=32, temperature=0)
        out.finish_reason                        # dsv4.FinishReason.LENGTH / STOP / ...
        list(out)                                # the token ids (out is a list of them)
        for event in engine.stream([0, 1234], max_new_tokens=32, top_p=0.9, seed=7):
            ...                                  # dsv4.Event: TOKEN events, then FINISHED
        rid = engine.submit([0, 1234], user_tag=5)   # raises dsv4.QueueFull when refused
        engine.poll(timeout_s=1.0)               # events of submit()-ed requests

    # Prefill/decode disaggregation (role = "prefill" / "decode", the "pd" params; the same
    # request, with the same pd_room, goes to both engines):
    #   endpoint = prefill.pd_endpoint()         # "tcp://host:port"; InvalidArgument if unified
    #   prefill.submit(prompt, pd_room=7)
    #   decode.generate(prompt, pd_room=7, pd_peer=endpoint)    # the tokens (a Generation)
    #   the prefill request ends FINISHED with FinishReason.TRANSFERRED once decode has its KV;
    #   a failed transfer ends a request with an ERROR event (generate(): KVTransferError, or
    #   Timeout for a PD deadline)

Failures raise a subclass of dsv4.Error carrying `.status` and `.message`. A value that its C
type cannot hold (a token id beyond int32_t, a negative count, a NUL inside a string, ...) is
refused before the call with dsv4.InvalidArgument (also a ValueError), a value of the wrong kind
(a float or bool where an integer is expected) with TypeError; nothing is truncated.

The package is pure Python and typed (PEP 561); libdsv4 is installed separately and found
through DSV4_LIBRARY, a source checkout's build, or an installed prefix (dsv4/_native.py has the
order); when none has it, `import dsv4` raises an OSError listing every place looked.
"""

import ctypes
import json
import queue
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Mapping, \
    Optional, Sequence, Union

from . import _cvalues, _native
from ._version import __version__
from .requests import (Event, EventKind, EngineState, FinishReason, Generation, RequestFields,
                       Router, ShutdownMode, build_request, finish_reason_name)
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

if TYPE_CHECKING:
    import numpy
    import numpy.typing
    from typing_extensions import Unpack

__all__ = [
    "__version__",
    "Detokenizer",
    "Engine",
    "Event",
    "EventKind",
    "EngineState",
    "FinishReason",
    "Generation",
    "RequestFields",
    "finish_reason_name",
    "ShutdownMode",
    "Params",
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

#: A params document: a dict (serialised to JSON) or JSON text. See docs/params.md.
Params = Union[Mapping[str, Any], str, bytes, bytearray]

_lib = _native.lib

# A C function of the (buf, cap, needed) shape, returning a status.
_TextCall = Callable[[Any, int, Any], int]


def _check(status: int) -> None:
    if status != 0:
        raise from_status(status, _lib.dsv4_last_error().decode("utf-8", "replace"))


def _read_text(call: _TextCall) -> str:
    """Runs a (buf, cap, needed) C function until its output fits; returns the text."""
    needed = ctypes.c_size_t(0)
    _check(call(None, 0, ctypes.byref(needed)))
    for _ in range(8):
        buf = ctypes.create_string_buffer(needed.value)
        status = call(buf, needed.value, ctypes.byref(needed))
        if status == BufferTooSmall.status:
            continue  # reports with live readings can grow between calls
        _check(status)
        text: str = buf.value.decode("utf-8")
        return text
    raise InternalError("the output kept growing between calls", InternalError.status)


def _params_bytes(params: Params) -> bytes:
    """The params as the NUL-terminated JSON text the C API takes (a dict is serialised; JSON text
    with a NUL in it is refused rather than cut short)."""
    if not isinstance(params, (str, bytes, bytearray)):
        params = json.dumps(params)
    raw: bytes = _cvalues.value("params", params, ctypes.c_char_p)
    return raw


def version() -> str:
    """The loaded library's version, "MAJOR.MINOR.PATCH" (the package's is __version__)."""
    text: str = _lib.dsv4_version().decode("ascii")
    return text


def status_name(status: int) -> str:
    """The name of a status code, e.g. "DSV4_ERR_CONFIG"."""
    name: str = _lib.dsv4_status_name(_cvalues.value("status", status, ctypes.c_int32)).decode(
        "ascii")
    return name


def _json(text: str) -> Dict[str, Any]:
    doc: Dict[str, Any] = json.loads(text)
    return doc


def default_params() -> Dict[str, Any]:
    """The full default params document."""
    return _json(_read_text(_lib.dsv4_params_default))


def validate_params(params: Params) -> Dict[str, Any]:
    """Validates params (a dict or JSON text) and returns the resolved document."""
    raw = _params_bytes(params)
    return _json(_read_text(lambda b, c, n: _lib.dsv4_params_validate(raw, b, c, n)))


def plan(params: Params) -> Dict[str, Any]:
    """The per-rank memory plan for params (a dict or JSON text), as a dict."""
    raw = _params_bytes(params)
    return _json(_read_text(lambda b, c, n: _lib.dsv4_plan(raw, b, c, n)))


def plan_text(params: Params) -> str:
    """The same plan as an aligned table."""
    raw = _params_bytes(params)
    return _read_text(lambda b, c, n: _lib.dsv4_plan_text(raw, b, c, n))


class Detokenizer:
    """Streaming detokenization: feed() one id at a time and get the text it completes ("" while
    an id ends inside a character), so the pieces concatenate to Engine.detokenize of all ids.
    Use one per stream, from one thread at a time; it may outlive its engine."""

    _handle: Optional[ctypes.c_void_p]

    def __init__(self, engine: "Engine") -> None:
        handle = ctypes.c_void_p()
        _check(_lib.dsv4_detokenizer_create(engine._live(), ctypes.byref(handle)))
        self._handle = handle

    def feed(self, token: int) -> str:
        """Adds `token`; returns the newly completed text (often "")."""
        if not self._handle:
            raise InvalidArgument("the detokenizer is closed", InvalidArgument.status)
        handle = self._handle
        tok = _cvalues.value("token", token, ctypes.c_int32)
        # A too-small buffer leaves the detokenizer unchanged, so _read_text's retry is safe.
        return _read_text(lambda b, c, n: _lib.dsv4_detokenizer_feed(handle, tok, b, c, n))

    def close(self) -> None:
        """Frees the detokenizer (idempotent)."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            _lib.dsv4_detokenizer_destroy(handle)

    def __enter__(self) -> "Detokenizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class Engine:
    """A loaded dsv4 engine. Use as a context manager, or call close() when done.

    Methods may be called from several threads at once; close() must not race with them.
    One internal thread polls the library and routes each event to the generate()/stream()
    call waiting for it, or to the queue read by poll() for requests made with submit().
    """

    _handle: Optional[ctypes.c_void_p]

    def __init__(self, params: Params) -> None:
        raw = _params_bytes(params)
        handle = ctypes.c_void_p()
        _check(_lib.dsv4_engine_create(raw, ctypes.byref(handle)))
        self._handle = handle
        self._router = Router(handle)
        self._vocab: int = self.model_info()["vocab_size"]

    def close(self) -> None:
        """Aborts what is in flight and frees the engine (idempotent)."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            # The library's threads end first (every request gets its terminal event), then
            # the poller, then the handle.
            _lib.dsv4_engine_shutdown(handle, ShutdownMode.ABORT, -1)
            self._router.close()
            _lib.dsv4_engine_destroy(handle)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def _live(self) -> ctypes.c_void_p:
        if not self._handle:
            raise InvalidArgument("the engine is closed", InvalidArgument.status)
        return self._handle

    def model_info(self) -> Dict[str, Any]:
        """Configuration summary, parameter count and resident bytes by dtype, and what a server
        needs: vocab_size, bos_token_id, eos_token_ids, context_limit, has_tokenizer,
        has_chat_template (see dsv4_model_info)."""
        handle = self._live()
        return _json(_read_text(lambda b, c, n: _lib.dsv4_model_info(handle, b, c, n)))

    def state(self) -> "tuple[EngineState, str]":
        """(EngineState, reason): where the engine stands, e.g. (READY, "ready: 0 requests in
        flight") or (DRAINING, "shutting down (drain): 3 requests still running"). Works on a
        shut-down or failed engine; never blocks."""
        handle = self._live()
        state = ctypes.c_int32(-1)
        reason = _read_text(
            lambda b, c, n: _lib.dsv4_engine_state(handle, ctypes.byref(state), b, c, n))
        return EngineState(state.value), reason

    def params_resolved(self) -> Dict[str, Any]:
        """The params this engine runs with, every default filled in (a dict that
        validate_params and Engine() accept and resolve to the same params)."""
        handle = self._live()
        return _json(_read_text(lambda b, c, n: _lib.dsv4_params_resolved(handle, b, c, n)))

    def pd_endpoint(self) -> str:
        """The address PD peers reach this engine at, "tcp://host:port" (`pd.advertise`, else
        the address `pd.listen` bound): a prefill engine's endpoint is what decode requests
        pass as `pd_peer`. InvalidArgument in the unified role, which has none."""
        handle = self._live()
        return _read_text(lambda b, c, n: _lib.dsv4_pd_endpoint(handle, b, c, n))

    def tokenize(self, text: str, add_special: bool = True) -> List[int]:
        """Token ids of `text` by the checkpoint's tokenizer.json, as Hugging Face tokenizers'
        encode(text, add_special_tokens=add_special). Unsupported when the checkpoint has no
        tokenizer.json (pass ids instead)."""
        handle = self._live()
        raw = _cvalues.value("text", text, ctypes.c_char_p)
        n = ctypes.c_size_t(0)
        _check(_lib.dsv4_tokenize(handle, raw, int(add_special), None, 0, ctypes.byref(n)))
        ids = (ctypes.c_int32 * n.value)()
        _check(_lib.dsv4_tokenize(handle, raw, int(add_special), ids, n.value, ctypes.byref(n)))
        return list(ids)

    def detokenize(self, tokens: Iterable[int]) -> str:
        """The text of `tokens`, special tokens included (decode(ids, skip_special_tokens=False)).
        InvalidArgument for an id outside the vocabulary; Unsupported without tokenizer.json."""
        handle = self._live()
        ids = _cvalues.array("tokens", tokens, ctypes.c_int32)
        return _read_text(lambda b, c, n: _lib.dsv4_detokenize(handle, ids, len(ids), b, c, n))

    def chat_apply(self, messages: Sequence[Mapping[str, Any]],
                   add_generation_prompt: bool = True) -> str:
        """The prompt text tokenizer_config.json's chat_template renders for `messages` (dicts
        such as {"role": "user", "content": "Hi"}), as transformers' apply_chat_template(...,
        tokenize=False). Tokenize it with add_special=False: the template writes BOS itself.
        Unsupported without a chat template; InvalidArgument when the template refuses."""
        handle = self._live()
        raw = _cvalues.value("messages", json.dumps(list(messages)), ctypes.c_char_p)
        flag = int(add_generation_prompt)
        return _read_text(lambda b, c, n: _lib.dsv4_chat_apply(handle, raw, flag, b, c, n))

    def detokenizer(self) -> "Detokenizer":
        """A streaming detokenizer over this engine's tokenizer (see Detokenizer)."""
        return Detokenizer(self)

    def score(self, tokens: Iterable[int]) -> "numpy.typing.NDArray[numpy.float32]":
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

    def submit(self, prompt: Iterable[int], **fields: "Unpack[RequestFields]") -> int:
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

    def poll(self, timeout_s: Optional[float] = 0.0) -> List[Event]:
        """Events of requests made with submit(): waits up to timeout_s (None: until one
        arrives, or the engine has shut down and every event is taken) for the first, then
        returns every one already there."""
        self._live()
        out: List[Event] = []
        general = self._router.general
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not out:
            try:
                # In slices, so a wait for ever ends when the engine has ended and drained.
                wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                out.append(general.get(timeout=wait) if wait > 0 else general.get_nowait())
            except queue.Empty:
                if self._router.drained.is_set() and general.empty():
                    return out
                if deadline is not None and time.monotonic() >= deadline:
                    return out
        while True:
            try:
                out.append(self._router.general.get_nowait())
            except queue.Empty:
                return out

    def abort(self, request_id: int) -> None:
        """Ends a request (FINISHED / ABORTED); NotFound if it is unknown or already ended."""
        rid = _cvalues.value("request_id", request_id, ctypes.c_uint64)
        _check(_lib.dsv4_abort(self._live(), rid))

    def stream(self, prompt: Iterable[int],
               **fields: "Unpack[RequestFields]") -> Iterator[Event]:
        """Submits and yields the request's events: TOKEN events, then the terminal one.
        Closing the iterator early aborts the request and waits for it to end."""
        self._live()
        req, keep = build_request(prompt, fields)
        rid, q = self._router.submit(req, private=True)
        del keep
        assert q is not None  # private=True always makes the request's queue
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

    def generate(self, prompt: Iterable[int], **fields: "Unpack[RequestFields]") -> Generation:
        """Runs a request to its end (blocking) and returns a Generation: the generated token
        ids (a list, as generate() always returned) with `.finish_reason`, `.logprobs` (with
        logprobs=True) and the FINISHED event's usage. An ERROR event raises the matching
        dsv4.Error."""
        tokens: List[int] = []
        logprobs: List[float] = []
        for event in self.stream(prompt, **fields):
            if event.kind == EventKind.TOKEN:
                tokens.append(event.token)
                logprobs.append(event.logprob)
            elif event.kind == EventKind.ERROR:
                raise from_status(event.status, "request {} failed: {}".format(
                    event.request_id, event.message or status_name(event.status)))
            else:
                return Generation(tokens, event, logprobs if fields.get("logprobs") else None)
        # stream() returns only after a terminal event, and an ERROR one raised above.
        raise InternalError("request ended without a terminal event", InternalError.status)

    def cache_stats(self) -> Dict[str, Any]:
        """The prefix cache per pool and tier (used / total units and bytes) and its counters
        (hits by tier, load-backs, backups, evictions): a dict, see docs/hicache.md."""
        handle = self._live()
        return _json(_read_text(lambda b, c, n: _lib.dsv4_cache_stats(handle, b, c, n)))

    def metrics(self) -> Dict[str, Any]:
        """Counters (totals since creation), latency sums/counts and gauges as a flat dict
        (struct dsv4_metrics; pool units as nested dicts). Cheap: never waits for a step."""
        m = _native.Metrics()
        m.struct_size = ctypes.sizeof(m)
        _check(_lib.dsv4_metrics_get(self._live(), ctypes.byref(m)))
        if m.struct_size != ctypes.sizeof(m):
            raise InternalError("dsv4_metrics layout mismatch: the library filled {} bytes, this "
                                "binding expects {}: reinstall matching versions".format(
                                    m.struct_size, ctypes.sizeof(m)))
        out: Dict[str, Any] = {}
        for field in m._fields_[1:]:
            name, kind = field[0], field[1]
            value = getattr(m, name)
            if kind is _native.Units:
                value = {f[0]: getattr(value, f[0]) for f in _native.Units._fields_}
            out[name] = value
        return out

    def prometheus(self) -> str:
        """The metrics in the Prometheus text format (serve as text/plain; version=0.0.4)."""
        handle = self._live()
        return _read_text(lambda b, c, n: _lib.dsv4_metrics_prometheus(handle, b, c, n))

    def cache_flush(self, tier: str = "all") -> None:
        """Drops every unlocked cached prefix from "device" (host copies stay), "host" or
        "all"."""
        _check(_lib.dsv4_cache_flush(self._live(), _cvalues.value("tier", tier, ctypes.c_char_p)))

    def shutdown(self, mode: ShutdownMode = ShutdownMode.DRAIN,
                 timeout_s: Optional[float] = None) -> None:
        """Stops intake; DRAIN lets accepted requests finish, ABORT ends them. Waits up to
        timeout_s (None: as long as it takes, else 0 to 2147483.647); raises Timeout if still
        draining."""
        mode = _cvalues.value("mode", mode, ctypes.c_int32)
        ms = _cvalues.timeout_ms("timeout_s", timeout_s)
        _check(_lib.dsv4_engine_shutdown(self._live(), mode, ms))


