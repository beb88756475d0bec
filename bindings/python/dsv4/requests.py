"""Requests and events: the Python face of dsv4_submit / dsv4_poll / dsv4_abort."""

import ctypes
import dataclasses
import enum
import queue
import threading
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, TypedDict, Union

from . import _cvalues, _native
from .errors import from_status

# Bytes of struct dsv4_event before `message`: events this short carry none.
_MESSAGE_OFFSET = _native.Event.message.offset

_lib = _native.lib


class EventKind(enum.IntEnum):
    TOKEN = 1
    FINISHED = 2
    ERROR = 3


class FinishReason(enum.IntEnum):
    """DSV4_FINISH_*; `reason.name.lower()` is the name the metrics' `finish_reason` label uses
    ("length", "stop", "aborted", "timeout", "transferred")."""

    NONE = 0
    LENGTH = 1
    STOP = 2
    ABORTED = 3
    TIMEOUT = 4
    #: Prefill role: the decode engine confirmed it received the request's KV and state and
    #: continues the request (its TOKEN events come from the decode engine).
    TRANSFERRED = 5


def finish_reason_name(reason: int) -> str:
    """The library's name of a DSV4_FINISH_* value ("stop", "length", ...; "unknown" for a
    value it does not define)."""
    name: bytes = _lib.dsv4_finish_reason_name(
        _cvalues.value("reason", reason, ctypes.c_int32))
    return name.decode("ascii")


class EngineState(enum.IntEnum):
    """DSV4_STATE_*: what Engine.state() reports. LOADING is never reported by an engine (it
    exists once loaded); it is there for hosts that report a state before they have one."""

    LOADING = 0
    READY = 1
    DRAINING = 2
    STOPPED = 3
    FAILED = 4


class ShutdownMode(enum.IntEnum):
    DRAIN = 0
    ABORT = 1


@dataclasses.dataclass(frozen=True)
class Event:
    """One event; attributes carry the C field names (struct dsv4_event)."""

    request_id: int
    user_tag: int
    kind: EventKind
    token: int
    logprob: float
    finish_reason: FinishReason
    status: int
    prompt_tokens: int
    cached_tokens_device: int
    cached_tokens_host: int
    generated_tokens: int
    queue_us: int
    ttft_us: int
    elapsed_us: int
    #: ERROR events: what went wrong and the fix (None otherwise).
    message: Optional[str] = None

    @property
    def terminal(self) -> bool:
        """FINISHED or ERROR: the request's last event."""
        return self.kind != EventKind.TOKEN

    @classmethod
    def from_c(cls, e: _native.Event) -> "Event":
        return cls(
            request_id=e.request_id, user_tag=e.user_tag, kind=EventKind(e.kind), token=e.token,
            logprob=e.logprob, finish_reason=FinishReason(e.finish_reason), status=e.status,
            prompt_tokens=e.prompt_tokens, cached_tokens_device=e.cached_tokens_device,
            cached_tokens_host=e.cached_tokens_host, generated_tokens=e.generated_tokens,
            queue_us=e.queue_us, ttft_us=e.ttft_us, elapsed_us=e.elapsed_us,
            # Owned by the library until the next poll on this thread: copied here.
            message=e.message.decode("utf-8", "replace")
            if e.struct_size > _MESSAGE_OFFSET and e.message else None)


class Generation(List[int]):
    """What Engine.generate() returns: the generated token ids, as a list, with how the request
    ended.

    It is a list subclass so that code written when generate() returned a plain list keeps
    working (indexing, len, slicing, `== [..]`); equality is therefore the tokens' alone, and
    slices or sums are plain lists. The rest: `finish_reason` (LENGTH, STOP: EOS or a stop
    token, which is then the last token, ABORTED, TIMEOUT, TRANSFERRED), `logprobs` (one per
    token when the request asked for them, else None) and `event`, the terminal FINISHED event
    with the request's usage and timings (the common ones are properties here too)."""

    finish_reason: FinishReason
    logprobs: Optional[List[float]]
    event: Event

    def __init__(self, tokens: Iterable[int], event: Event,
                 logprobs: Optional[List[float]] = None) -> None:
        super().__init__(tokens)
        self.event = event
        self.finish_reason = event.finish_reason
        self.logprobs = logprobs

    @property
    def tokens(self) -> List[int]:
        """The token ids as a plain list."""
        return list(self)

    @property
    def request_id(self) -> int:
        return self.event.request_id

    @property
    def prompt_tokens(self) -> int:
        return self.event.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (device and host tiers together)."""
        return self.event.cached_tokens_device + self.event.cached_tokens_host

    @property
    def generated_tokens(self) -> int:
        return self.event.generated_tokens

    def __repr__(self) -> str:
        return "Generation({}, finish_reason={})".format(list.__repr__(self),
                                                        self.finish_reason.name)


class RequestFields(TypedDict, total=False):
    """The keyword fields of Engine.submit / stream / generate: struct dsv4_request's fields
    (see include/dsv4.h and docs/engine.md), each checked against its C type before the call.
    Kept equal to _FIELDS below by tests/python/test_packaging.py."""

    max_new_tokens: int
    stop_tokens: Iterable[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    logit_bias_tokens: Iterable[int]
    logit_bias_values: Iterable[float]
    priority: int
    deadline_ms: int
    cache_salt: Union[str, bytes, None]
    user_tag: int
    logprobs: Union[bool, int]
    pd_room: int
    pd_peer: Union[str, bytes, None]
    ignore_eos: Union[bool, int]
    stop_sequences: Iterable[Iterable[int]]


_SCALARS = {"max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "priority",
            "deadline_ms", "user_tag", "pd_room"}
# NUL-terminated strings (None: NULL, the default).
_STRINGS = ("cache_salt", "pd_peer")
_FLAGS = ("logprobs", "ignore_eos")
_FIELDS = _SCALARS | set(_STRINGS) | set(_FLAGS) | {"stop_tokens", "stop_sequences",
                                                    "logit_bias_tokens", "logit_bias_values"}
# The C type of each field, from the struct's own declaration.
_CTYPE: Dict[str, Any] = {f[0]: f[1] for f in _native.Request._fields_}


def build_request(prompt: Iterable[int],
                  fields: Mapping[str, Any]) -> Tuple[_native.Request, List[Any]]:
    """A dsv4_request for `prompt` and keyword fields; returns it with the buffers it points to
    (they must stay alive until dsv4_submit returns). Every value is checked against its C type
    first (see _cvalues): InvalidArgument or TypeError name the field."""
    unknown = set(fields) - _FIELDS
    if unknown:
        raise TypeError("unknown request field(s): {} (valid: {})".format(
            ", ".join(sorted(unknown)), ", ".join(sorted(_FIELDS))))
    req = _native.Request()
    status = _lib.dsv4_request_init(ctypes.byref(req), ctypes.sizeof(req))
    if status != 0:
        raise from_status(status, _lib.dsv4_last_error().decode("utf-8", "replace"))
    keep: List[Any] = []

    def ids(name: str, values: Iterable[int]) -> Tuple[Any, int]:
        arr = _cvalues.array(name, values, ctypes.c_int32)
        keep.append(arr)
        return arr, len(arr)

    req.prompt, req.prompt_len = ids("prompt", prompt)
    for name in sorted(_SCALARS & set(fields)):
        setattr(req, name, _cvalues.value(name, fields[name], _CTYPE[name]))
    if "stop_tokens" in fields:
        req.stop_tokens, req.stop_tokens_len = ids("stop_tokens", fields["stop_tokens"])
    if "logit_bias_tokens" in fields or "logit_bias_values" in fields:
        req.logit_bias_tokens, n = ids("logit_bias_tokens", fields.get("logit_bias_tokens", []))
        vals = _cvalues.array("logit_bias_values", fields.get("logit_bias_values", []),
                              ctypes.c_float)
        if n != len(vals):
            raise ValueError("logit_bias_tokens and logit_bias_values differ in length")
        keep.append(vals)
        req.logit_bias_values, req.logit_bias_len = vals, n
    for name in _STRINGS:
        if fields.get(name) is not None:
            text = _cvalues.value(name, fields[name], ctypes.c_char_p)
            keep.append(text)
            setattr(req, name, text)
    if fields.get("stop_sequences"):
        # A list of token-id sequences, flattened for C: the tokens one after another and
        # each sequence's length (the library refuses an empty one, naming it).
        seqs = fields["stop_sequences"]
        if isinstance(seqs, (str, bytes)) or not all(
                hasattr(s, "__len__") and not isinstance(s, (str, bytes)) for s in seqs):
            raise TypeError("stop_sequences must be a list of token-id lists, e.g. [[13, 13], "
                            "[2]]: {!r}".format(seqs))
        flat = [t for s in seqs for t in s]
        tokens = _cvalues.array("stop_sequences", flat, ctypes.c_int32)
        lens = _cvalues.array("stop_sequence_lens", [len(s) for s in seqs], _native.size_t)
        keep.extend((tokens, lens))
        req.stop_sequences, req.stop_sequence_lens = tokens, lens
        req.stop_sequences_len = len(lens)
    # Flags: a bool, or an integer that fits the uint8_t (non-zero: on).
    for name in _FLAGS:
        flag = fields.get(name, False)
        setattr(req, name, int(flag) if isinstance(flag, bool) else _cvalues.value(
            name, flag, _CTYPE[name]))
    return req, keep


class Router:
    """The one poller of an engine: routes each event to the queue of the request that waits
    for it (generate / stream), or to the general queue read by Engine.poll."""

    def __init__(self, handle: ctypes.c_void_p) -> None:
        self._handle = handle
        self._lock = threading.Lock()
        self._mine: Dict[int, "queue.Queue[Event]"] = {}
        self.general: "queue.Queue[Event]" = queue.Queue()
        self._stop = threading.Event()
        # Set once the engine has ended and its last event was routed.
        self.drained = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsv4-events", daemon=True)
        self._thread.start()

    def submit(self, req: _native.Request,
               private: bool) -> Tuple[int, "Optional[queue.Queue[Event]]"]:
        """Submits under the routing lock, so no event can be routed before its queue exists."""
        rid = ctypes.c_uint64(0)
        with self._lock:
            status = _lib.dsv4_submit(self._handle, ctypes.byref(req), ctypes.byref(rid))
            if status != 0:
                raise from_status(status, _lib.dsv4_last_error().decode("utf-8", "replace"))
            q: "Optional[queue.Queue[Event]]" = None
            if private:
                q = self._mine[rid.value] = queue.Queue()
        return rid.value, q

    def _run(self) -> None:
        cap = 64
        buf = (_native.Event * cap)()
        n = ctypes.c_size_t(0)
        # Once the engine thread has ended (shut down or failed) every event is queued and
        # dsv4_poll returns at once: drain with a poll(0) and stop instead of spinning until
        # the engine is closed.
        ended = False
        while not self._stop.is_set():
            buf[0].struct_size = ctypes.sizeof(_native.Event)
            status = _lib.dsv4_poll(self._handle, buf, cap, ctypes.byref(n), 0 if ended else 100)
            if status != 0:
                self._stop.wait(0.1)
                continue
            if n.value == 0:
                if ended:
                    self.drained.set()
                    return
                ended = self._engine_ended()
                continue
            with self._lock:
                for i in range(n.value):
                    e = Event.from_c(buf[i])
                    q = self._mine.get(e.request_id)
                    if q is None:
                        self.general.put(e)
                    else:
                        q.put(e)
                        if e.terminal:
                            del self._mine[e.request_id]

    def _engine_ended(self) -> bool:
        """STOPPED or FAILED: set before the engine's event queue closes, so one more poll
        takes whatever is left."""
        state = ctypes.c_int32(-1)
        status = _lib.dsv4_engine_state(self._handle, ctypes.byref(state), None, 0, None)
        return status == 0 and state.value in (EngineState.STOPPED, EngineState.FAILED)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
