"""OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`) and which HTTP status
each failure of a request gets."""

from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

from inferline.contract.schema import Request
from inferline.producer.errors import (
    ClientClosed,
    InferenceError,
    Overloaded,
    PromptTooLong,
    RateLimited,
    RequestCancelled,
    RequestRejected,
    RequestTimeout,
)


class OpenAIError(Exception):
    """A failure to answer in OpenAI's error shape with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(param: str | None, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def from_validation(exc: ValidationError, rename: dict[str, str]) -> OpenAIError:
    """400 naming the field, from the contract's validation (``rename``: contract field -> OpenAI
    parameter)."""
    err = exc.errors(include_url=False, include_input=False, include_context=False)[0]
    loc = [str(p) for p in err["loc"]]
    if loc:
        loc[0] = rename.get(loc[0], loc[0])
    path = ".".join(loc) or None
    message = err["msg"].removeprefix("Value error, ")
    return bad_request(
        path.split(".")[0] if path else None, f"{path}: {message}" if path else message
    )


def named_param(exc: InferenceError, rename: dict[str, str]) -> str | None:
    """The parameter a worker's rejection names ("max_tokens: ..."), as the client called it."""
    field = exc.message.removeprefix(f"{exc.code}: ").split(":", 1)[0].split(".", 1)[0]
    return rename.get(field, field) if field in Request.model_fields else None


def from_inference(
    exc: InferenceError,
    retry_after_s: int,
    prompt_param: str = "messages",
    rename: dict[str, str] | None = None,
) -> OpenAIError:
    """The status of a request the worker (or the client side) ended without text; a rejection
    names the parameter the worker's message starts with (``rename``: contract field -> OpenAI
    parameter)."""
    text = exc.message
    rename = {"prompt_token_ids": prompt_param, **(rename or {})}
    if isinstance(exc, (RateLimited, Overloaded)):
        kind = "rate_limit_exceeded" if isinstance(exc, RateLimited) else "overloaded"
        return OpenAIError(
            429,
            text,
            type="rate_limit_error" if kind == "rate_limit_exceeded" else "server_error",
            code=kind,
            headers={"Retry-After": str(retry_after_s)},
        )
    if isinstance(exc, PromptTooLong):
        param = named_param(exc, rename) or prompt_param
        return bad_request(param, text, code="context_length_exceeded")
    if isinstance(exc, RequestRejected):
        return bad_request(named_param(exc, rename), text, code="invalid_request")
    if isinstance(exc, RequestTimeout):
        return OpenAIError(504, text, type="timeout", code="timeout")
    if isinstance(exc, (RequestCancelled, ClientClosed)):
        # Cancelled by someone else, or the gateway is shutting down: worth a retry elsewhere.
        return OpenAIError(503, text, type="server_error", code="cancelled")
    return OpenAIError(500, text, type="server_error", code="internal")
