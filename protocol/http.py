"""FastAPI glue shared by both HTTP edges: exception handlers that always answer with the API's
error object (OpenAI's; Anthropic's on the Messages API paths), 400 for validation, never 422,
500 without a traceback; and a body-size limit."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protocol.anthropic_errors import error_body
from protocol.errors import APIError, internal_error, payload_too_large
from protocol.parsing import validation_error_to_api_error

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# An oversized body is read and discarded up to this much so the client (which writes the whole
# body before it reads) sees the 413 instead of a reset connection; beyond it we hang up.
DEFAULT_DRAIN_LIMIT_BYTES = 256 * 1024 * 1024


def bearer_token(header: str) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header value, None if it is not one."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def api_key_of(headers: Mapping[str, str]) -> str | None:
    """The client's API key: `Authorization: Bearer KEY` (OpenAI's SDK) or `x-api-key: KEY`
    (Anthropic's). `headers`: lower-case names."""
    token = bearer_token(headers.get("authorization", ""))
    if token is None:
        token = headers.get("x-api-key", "").strip() or None
    return token


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """The error as the API served on `path` writes it."""
    status, body = error_body(err, path)
    return JSONResponse(body, status_code=status, headers=err.headers)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request.url.path)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_error_to_api_error(exc.errors()), request.url.path)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = APIError(exc.status_code, str(exc.detail), err_type, None, code, dict(exc.headers or {}))
    return error_response(err, request.url.path)


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(internal_error(), request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unhandled)


class BodySizeLimitMiddleware:
    """Answers 413 with the OpenAI error object when a request body exceeds `max_body_bytes`,
    whether announced by Content-Length or found while reading a chunked body."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, drain_limit_bytes: int = DEFAULT_DRAIN_LIMIT_BYTES):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.drain_limit_bytes = drain_limit_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        path = scope.get("path", "")
        if declared is not None and declared > self.max_body_bytes:
            drained = await self._drain(receive, 0)
            await self._send_413(send, path, close=not drained)
            return
        received = 0
        too_large = False
        drained = True

        async def limited_receive() -> Message:
            nonlocal received, too_large, drained
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    too_large = True
                    if message.get("more_body", False):
                        drained = await self._drain(receive, received)
                    raise payload_too_large(self.max_body_bytes)
            return message

        async def guarded_send(message: Message) -> None:
            # Frameworks may wrap a failed body read in their own 400; the answer is still 413.
            if not too_large:
                await send(message)
            elif message["type"] == "http.response.start":
                await self._send_413(send, path, close=not drained)

        await self.app(scope, limited_receive, guarded_send)

    async def _drain(self, receive: Receive, already: int) -> bool:
        """Read and drop the rest of the body; False when it ran past the drain limit."""
        total = already
        while total <= self.drain_limit_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return False
            total += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False

    async def _send_413(self, send: Send, path: str, close: bool) -> None:
        _, error = error_body(payload_too_large(self.max_body_bytes), path)
        body = json.dumps(error).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
