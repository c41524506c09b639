"""Errors on the Messages API's paths in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`, with Anthropic's status codes (an overloaded or unavailable server answers 529);
every other path keeps OpenAI's. Both HTTP edges choose the shape by the request's path."""

from __future__ import annotations

from typing import Any

from protocol.errors import APIError
from protocol.sse import DONE, sse_error, sse_event

MESSAGES_PATH = "/v1/messages"
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          504: "timeout_error", 529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_status(err: APIError) -> int:
    return 529 if err.status_code == 503 else err.status_code


def anthropic_error(err: APIError) -> dict[str, Any]:
    status = anthropic_status(err)
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_body(err: APIError, path: str) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of an error answered on `path`."""
    if is_anthropic_path(path):
        return anthropic_status(err), anthropic_error(err)
    return err.status_code, err.to_dict()


def stream_error(err: APIError, path: str) -> bytes:
    """What ends a stream that fails after its headers went out: Anthropic's `error` event, or
    OpenAI's error data event and `[DONE]`."""
    if is_anthropic_path(path):
        return sse_event("error", anthropic_error(err))
    return sse_error(err) + DONE
