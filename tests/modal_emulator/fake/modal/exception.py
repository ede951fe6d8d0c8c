"""The exception types of `modal.exception` (modal 1.6.4, modal/exception.py) that the emulator raises.

Same names and the same hierarchy, so `except modal.exception.X` in vrl behaves as against Modal.
"""


class Error(Exception):
    """Base class for all Modal errors."""


class AuthError(Error):
    pass


class InvalidError(Error):
    pass


class ConflictError(InvalidError):
    pass


class NotFoundError(Error):
    pass


class AlreadyExistsError(Error):
    pass


class RemoteError(Error):
    pass


class TimeoutError(Error):  # noqa: A001 - Modal's own name
    pass


class SandboxTimeoutError(TimeoutError):
    pass


class FunctionTimeoutError(TimeoutError):
    pass


class OutputExpiredError(TimeoutError):
    pass


class SandboxTerminatedError(Error):
    pass


class ExecutionError(Error):
    pass


class DeserializationError(Error):
    pass


class SerializationError(Error):
    pass


class InternalFailure(Error):
    pass


class DeprecationError(UserWarning):
    pass


class AsyncUsageWarning(UserWarning):
    """Warning emitted when a blocking Modal interface is used in an async context."""


class InputCancellation(BaseException):
    """Raised when the current input is cancelled by the task."""
