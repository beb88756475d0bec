"""One exception class per dsv4 status code."""

from typing import Dict, Optional, Type


class Error(Exception):
    """A failed dsv4 call. `status` is the DSV4_ERR_* code, `message` dsv4's explanation."""

    #: The DSV4_ERR_* code (negative); None only on the base class.
    status: Optional[int] = None

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status

    def __str__(self) -> str:
        return self.message


class InvalidArgument(Error, ValueError):
    """DSV4_ERR_INVALID_ARGUMENT: from the library, or raised by the binding before a call for a
    value its C type cannot hold. Also a ValueError, as Python code expects of a bad value."""

    status = -1


class ConfigError(Error):
    status = -2


class FileError(Error):
    """A file is missing or unreadable (DSV4_ERR_IO); not named IOError, which is a builtin."""

    status = -3


class ModelFormatError(Error):
    status = -4


class CapacityError(Error):
    status = -5


class QueueFull(Error):
    status = -6


class Timeout(Error):
    status = -7


class Aborted(Error):
    status = -8


class KVTransferError(Error):
    status = -9


class BufferTooSmall(Error):
    status = -10


class Unsupported(Error):
    status = -11


class ShutDown(Error):
    status = -12


class NotFound(Error):
    status = -13


class InternalError(Error):
    status = -99


BY_STATUS: Dict[Optional[int], Type[Error]] = {
    cls.status: cls
    for cls in (
        InvalidArgument,
        ConfigError,
        FileError,
        ModelFormatError,
        CapacityError,
        QueueFull,
        Timeout,
        Aborted,
        KVTransferError,
        BufferTooSmall,
        Unsupported,
        ShutDown,
        NotFound,
        InternalError,
    )
}


def from_status(status: int, message: str) -> Error:
    """The exception for a status code (the base Error for codes dsv4 never returns)."""
    cls = BY_STATUS.get(status, Error)
    return cls(message, status)
