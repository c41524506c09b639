"""The OpenAI error object and the exception that carries it to the HTTP edge.

Every error either HTTP edge (replica server or gateway) returns is
`{"error": {"message", "type", "param", "code"}}` with OpenAI's status codes and string-or-null
`code` — never FastAPI's 422 body, never a traceback.
"""

from __future__ import annotations

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class APIError(Exception):
    """An error with its HTTP status, raised anywhere under a route and rendered by the handlers."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        )

    def to_dict(self) -> dict:
        return self.to_response().model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unsupported(param: str, what: str) -> APIError:
    """A field we recognise but do not implement: refused loudly, never silently ignored."""
    return APIError(400, f"{what} is not supported by this server", "invalid_request_error", param, "unsupported_parameter")


def context_length_exceeded(message: str, param: str | None = "messages") -> APIError:
    return APIError(400, message, "invalid_request_error", param, "context_length_exceeded")


def unauthorized(message: str = "Incorrect API key provided.") -> APIError:
    return APIError(401, message, "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def not_found(message: str) -> APIError:
    return APIError(404, message, "invalid_request_error", None, "not_found")


def payload_too_large(limit_bytes: int) -> APIError:
    return APIError(
        413,
        f"Request body too large: the limit is {limit_bytes} bytes.",
        "invalid_request_error",
        None,
        "request_too_large",
    )


def service_unavailable(message: str, retry_after_s: int | None = 1, code: str | None = "service_unavailable") -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else {}
    return APIError(503, message, "server_error", None, code, headers)


def internal_error(message: str = "The server had an error while processing your request.") -> APIError:
    return APIError(500, message, "server_error", None, "internal_error")
