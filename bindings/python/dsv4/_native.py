"""Loads libdsv4 with ctypes and declares the C functions' signatures."""

import ctypes
import os
from pathlib import Path

_SONAME = "libdsv4.so"


def _candidates():
    env = os.environ.get("DSV4_LIBRARY")
    if env:
        yield Path(env)
        return
    here = Path(__file__).resolve().parent
    yield from sorted(here.glob(_SONAME + "*"))
    # A source checkout: bindings/python/dsv4 → repository root → target/release.
    for parent in here.parents:
        built = parent / "target" / "release" / _SONAME
        if built.exists():
            yield built
            break


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.exists():
            return ctypes.CDLL(str(path))
    raise OSError(
        "libdsv4 not found (tried: {}): set DSV4_LIBRARY to the library's path, put it next to "
        "the dsv4 package, or build it with `make lib`".format(", ".join(tried) or "nothing")
    )


lib = _load()

c_char_p = ctypes.c_char_p
size_t = ctypes.c_size_t
status_t = ctypes.c_int32

lib.dsv4_last_error.restype = c_char_p
lib.dsv4_last_error.argtypes = []
lib.dsv4_status_name.restype = c_char_p
lib.dsv4_status_name.argtypes = [status_t]
lib.dsv4_version.restype = c_char_p
lib.dsv4_version.argtypes = []
lib.dsv4_params_default.restype = status_t
lib.dsv4_params_default.argtypes = [ctypes.c_void_p, size_t, ctypes.POINTER(size_t)]
for _name in ("dsv4_params_validate", "dsv4_plan", "dsv4_plan_text"):
    _fn = getattr(lib, _name)
    _fn.restype = status_t
    _fn.argtypes = [c_char_p, ctypes.c_void_p, size_t, ctypes.POINTER(size_t)]

lib.dsv4_engine_create.restype = status_t
lib.dsv4_engine_create.argtypes = [c_char_p, ctypes.POINTER(ctypes.c_void_p)]
lib.dsv4_engine_destroy.restype = None
lib.dsv4_engine_destroy.argtypes = [ctypes.c_void_p]
lib.dsv4_score.restype = status_t
lib.dsv4_score.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), size_t,
                           ctypes.POINTER(ctypes.c_float), size_t]
lib.dsv4_model_info.restype = status_t
lib.dsv4_model_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p, size_t, ctypes.POINTER(size_t)]
