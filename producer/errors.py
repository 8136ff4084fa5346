"""The client's exceptions (all InferenceError), one per error code of the contract, and the one a
final ``done`` stands for (`error_for`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferline.contract.schema import DoneEvent, ErrorCode

if TYPE_CHECKING:
    from inferline.producer.reassembly import Result


class InferenceError(Exception):
    """A request that did not end in ``stop`` or ``length``: ``code`` is the contract's error
    code, ``result`` the partial Result when there is one."""

    code: ErrorCode = "internal"

    def __init__(
        self, message: str, *, request_id: str | None = None, result: Result | None = None
    ):
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.result = result


class RequestRejected(InferenceError):
    """The worker never ran the request (finish_reason ``rejected``)."""

    code: ErrorCode = "invalid_request"


class InvalidRequestError(RequestRejected):
    code: ErrorCode = "invalid_request"


class PromptTooLong(RequestRejected):
    code: ErrorCode = "prompt_too_long"


class RateLimited(RequestRejected):
    code: ErrorCode = "rate_limited"


class Overloaded(RequestRejected):
    code: ErrorCode = "overloaded"


class AnsweredBefore(RequestRejected):
    """A resubmission of a request answered before: its first final `done` is its answer."""

    code: ErrorCode = "answered_before"


class RequestTimeout(InferenceError):
    """The worker's deadline passed, or (``client_side``) no ``done`` came in time."""

    code: ErrorCode = "timeout"
    client_side = False


class ClientTimeout(RequestTimeout):
    client_side = True


class RequestCancelled(InferenceError):
    code: ErrorCode = "cancelled"


class WorkerError(InferenceError):
    code: ErrorCode = "internal"


class IncompleteStream(InferenceError):
    """Events went missing (a gap in ``seq``) and ``done`` carried no whole text to repair it."""


class ClientClosed(InferenceError):
    """The client was closed before the request finished."""


ERRORS_BY_CODE: dict[str, type[InferenceError]] = {
    "invalid_request": InvalidRequestError,
    "prompt_too_long": PromptTooLong,
    "rate_limited": RateLimited,
    "overloaded": Overloaded,
    "timeout": RequestTimeout,
    "cancelled": RequestCancelled,
    "internal": WorkerError,
    "answered_before": AnsweredBefore,
}
# When a done carries no error, its finish_reason decides.
_CODE_BY_REASON = {
    "rejected": "invalid_request",
    "timeout": "timeout",
    "cancelled": "cancelled",
    "error": "internal",
}


def error_for(done: DoneEvent) -> InferenceError | None:
    """The exception a final ``done`` stands for, or None when it succeeded."""
    if done.finish_reason in ("stop", "length"):
        return None
    code = done.error.code if done.error else _CODE_BY_REASON.get(done.finish_reason, "internal")
    # The code decides, not the reason: a request whose deadline passed in the queue is a timeout.
    cls = ERRORS_BY_CODE.get(code, WorkerError)
    message = done.error.message if done.error else f"finished with {done.finish_reason}"
    return cls(f"{code}: {message}", request_id=done.id)
