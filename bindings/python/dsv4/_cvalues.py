"""Checked conversion of the Python values the binding hands to libdsv4 into their C types.

ctypes converts silently: 2**32 + 5 stored in an int32_t is 5, -1 in a uint32_t is 4294967295,
1e300 in a float is inf, 3.7 through int() is 3, and a C string ends at its first NUL ("a\\0b"
is "a"). The library then sees a different, valid-looking request. Every value the binding passes
into a ctypes field or argument goes through `value` (one value) or `array` (a sequence) first:
a value its C type cannot hold raises InvalidArgument (also a ValueError), a value of the wrong
kind (a float or bool where an integer is expected, a number where a string is) raises TypeError;
both name the argument, the value and what the C type allows.
"""

import ctypes
import math
import operator
from typing import Any, Iterable, Optional, Tuple, Type

from .errors import InvalidArgument

# A ctypes scalar type (c_int32, c_float, c_char_p, ...).
CType = Type[Any]

_REAL_TYPES = (ctypes.c_float, ctypes.c_double)


def _int_range(ctype: CType) -> Tuple[str, int, int]:
    """(C name, lowest, highest) of an integer ctype, from its size and signedness (ctypes
    aliases types, e.g. c_size_t is c_uint64 on LP64, so the name comes from the layout)."""
    bits = 8 * ctypes.sizeof(ctype)
    signed = ctype(-1).value == -1
    if signed:
        return "int{}_t".format(bits), -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return "uint{}_t".format(bits), 0, (1 << bits) - 1


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:45] + "..." + text[-12:]


def _label(name: str, index: Optional[int]) -> str:
    return name if index is None else "{}[{}]".format(name, index)


def _is_bool(value: object) -> bool:
    # numpy's bool is not a Python bool but is refused the same way (it has no __index__ in
    # numpy 2, and True as a token id or a count is a mistake, not 1).
    return isinstance(value, bool) or type(value).__name__ in ("bool_", "bool")


def value(name: str, v: Any, ctype: CType, index: Optional[int] = None) -> Any:
    """`v` as the Python value to store in a `ctype` field or argument, or an exception naming
    `name` (and `index` within it). ctype: an integer type, c_float / c_double, or c_char_p (a
    str, UTF-8 encoded, or bytes; returned as bytes)."""
    if ctype is ctypes.c_char_p:
        return _text(name, v, index)
    if ctype in _REAL_TYPES:
        return _real(name, v, ctype, index)
    return _integer(name, v, ctype, index)


def _integer(name: str, v: Any, ctype: CType, index: Optional[int]) -> int:
    cname, lo, hi = _int_range(ctype)
    if _is_bool(v):
        raise TypeError("{} must be an integer ({}), not a bool: {}".format(
            _label(name, index), cname, _shown(v)))
    try:
        n = operator.index(v)  # int and numpy integers; floats and strings have no __index__
    except TypeError:
        raise TypeError("{} must be an integer ({}), not {}: {}".format(
            _label(name, index), cname, type(v).__name__, _shown(v))) from None
    if not lo <= n <= hi:
        raise InvalidArgument("{} = {} is out of range: the C type is {}, {} to {}".format(
            _label(name, index), n, cname, lo, hi))
    return n


_BIGGEST = {ctypes.c_float: 3.4028234663852886e38, ctypes.c_double: 1.7976931348623157e308}


def _real(name: str, v: Any, ctype: CType, index: Optional[int]) -> float:
    cname = "float" if ctype is ctypes.c_float else "double"
    wrong = TypeError("{} must be a number ({}), not {}: {}".format(
        _label(name, index), cname, type(v).__name__, _shown(v)))
    if _is_bool(v) or isinstance(v, (str, bytes)):
        raise wrong  # float() would parse a string
    x: Optional[float]
    try:
        x = float(v)
    except OverflowError:  # an int beyond any double
        x = None
    except (TypeError, ValueError):
        raise wrong from None
    # inf and NaN are passed on as given (the library judges them); a finite value that only
    # becomes infinite in the C type is refused.
    if x is None or math.isfinite(x) and not math.isfinite(ctype(x).value):
        raise InvalidArgument("{} = {} is out of range: the C type is {}, at most {:g} in "
                              "magnitude".format(_label(name, index), _shown(v), cname,
                                                 _BIGGEST[ctype]))
    return x


def _text(name: str, v: Any, index: Optional[int]) -> bytes:
    if isinstance(v, str):
        raw = v.encode("utf-8")
    elif isinstance(v, (bytes, bytearray)):
        raw = bytes(v)
    else:
        raise TypeError("{} must be a str, not {}: {}".format(
            _label(name, index), type(v).__name__, _shown(v)))
    at = raw.find(b"\0")
    if at >= 0:
        raise InvalidArgument("{} = {} contains a NUL at byte {}: a C string would end there; "
                              "remove it".format(_label(name, index), _shown(v), at))
    return raw


def array(name: str, values: Iterable[Any], ctype: CType) -> Any:
    """A ctypes array of `ctype` holding `values` (any iterable; numpy integer arrays are
    checked without a Python loop), each element checked as `value` does."""
    if hasattr(values, "dtype") and hasattr(values, "ndim") and ctype not in _REAL_TYPES \
            and ctype is not ctypes.c_char_p:
        return _int_ndarray(name, values, ctype)
    if isinstance(values, (str, bytes)):
        raise TypeError("{} must be a sequence of integers, not {}: {}".format(
            name, type(values).__name__, _shown(values)))
    try:
        items = list(values)
    except TypeError:
        raise TypeError("{} must be a sequence, not {}: {}".format(
            name, type(values).__name__, _shown(values))) from None
    return (ctype * len(items))(*[value(name, v, ctype, i) for i, v in enumerate(items)])


def _int_ndarray(name: str, a: Any, ctype: CType) -> Any:
    import numpy as np

    cname, lo, hi = _int_range(ctype)
    if a.ndim != 1:
        raise TypeError("{} must be one-dimensional, not of shape {}".format(name, a.shape))
    if a.dtype.kind not in "iu":
        # Object arrays (Python ints beyond int64 and the like) go element by element.
        if a.dtype.kind == "O":
            return array(name, a.tolist(), ctype)
        raise TypeError("{} must hold integers ({}), not {}".format(name, cname, a.dtype))
    if a.size:
        low, high = int(a.min()), int(a.max())
        if low < lo or high > hi:
            i = int(np.argmax(a < lo)) if low < lo else int(np.argmax(a > hi))
            raise InvalidArgument("{}[{}] = {} is out of range: the C type is {}, {} to {}".format(
                name, i, int(a[i]), cname, lo, hi))
    out = np.ascontiguousarray(a, dtype=np.dtype(ctype))
    return (ctype * len(out)).from_buffer_copy(out)


def timeout_ms(name: str, seconds: Optional[float]) -> int:
    """A timeout in seconds (None: wait as long as it takes) as the int32_t milliseconds of the C
    API (-1 = no limit). A positive timeout is rounded up, so it never becomes "do not wait"."""
    if seconds is None:
        return -1
    hi = _int_range(ctypes.c_int32)[2]
    try:
        x = _real(name, seconds, ctypes.c_double, None)
    except InvalidArgument:  # an int beyond any double: reported with the timeout's range
        x = math.inf
    ms = math.ceil(x * 1000) if math.isfinite(x) else None
    if ms is None or not 0 <= ms <= hi:
        raise InvalidArgument("{} = {} is out of range: use None (no limit) or 0 to {} seconds "
                              "(the C type is int32_t milliseconds)".format(
                                  name, _shown(seconds), hi / 1000))
    return ms
