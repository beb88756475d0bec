"""Python binding for dsv4 (ctypes over libdsv4).

    import dsv4
    dsv4.version()                       # "0.1.0"
    dsv4.default_params()                # dict: every key, see docs/params.md
    dsv4.validate_params({...})          # dict: the resolved document, sizes in bytes
    dsv4.plan({"model_path": "configs/deepseek-v4-flash", ...})        # dict
    print(dsv4.plan_text({...}))         # the same plan as a table

Failures raise a subclass of dsv4.Error carrying `.status` and `.message`.

The library is found through DSV4_LIBRARY, next to this package, or in a source checkout's
target/release.
"""

import ctypes
import json

from . import _native
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
    if isinstance(params, (bytes, bytearray)):
        return bytes(params)
    if isinstance(params, str):
        return params.encode("utf-8")
    return json.dumps(params).encode("utf-8")


def version():
    """The library's version, "MAJOR.MINOR.PATCH"."""
    return _lib.dsv4_version().decode("ascii")


def status_name(status):
    """The name of a status code, e.g. "DSV4_ERR_CONFIG"."""
    return _lib.dsv4_status_name(status).decode("ascii")


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
