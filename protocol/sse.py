"""Server-sent events as OpenAI frames them, and a streaming response that notices a client
leaving at once (and cancels the producer, so the generation behind it is aborted)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from protocol.errors import APIError

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_data(payload: BaseModel | dict[str, Any] | str, **dump_kwargs: Any) -> bytes:
    """One `data: {json}\\n\\n` event."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(**dump_kwargs)
    elif isinstance(payload, str):
        body = payload
    else:
        body = json.dumps(payload, separators=(",", ":"))
    return b"data: " + body.encode() + b"\n\n"


def sse_event(event: str, payload: dict[str, Any]) -> bytes:
    """A named event (`event: NAME` then `data: {json}`), for non-OpenAI streams."""
    return f"event: {event}\n".encode() + sse_data(payload)


def sse_error(error: APIError) -> bytes:
    """An error after the 200 headers went out: one error event (the caller then sends DONE)."""
    return sse_data(error.to_dict())


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` response that always watches for `http.disconnect` while streaming.

    Starlette only does so for ASGI spec < 2.4; there a departed client is noticed only at the
    next write, which for a queued request may be long. Here the producer is cancelled at once.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], status_code: int = 200, headers: dict[str, str] | None = None,
                 on_close: Callable[[], Awaitable[None]] | None = None):
        super().__init__(content, status_code=status_code, headers={**SSE_HEADERS, **(headers or {})})
        self.on_close = on_close  # always awaited at the end, even if the body never started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._stream_until_disconnect(receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self.on_close is not None:
                    await self.on_close()
        if self.background is not None:
            await self.background()

    async def _stream_until_disconnect(self, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream_then_stop() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away mid-write
                except Exception:  # headers are out: all that is left is to end the body
                    logger.exception("event stream producer failed")
                tg.cancel_scope.cancel()

            tg.start_soon(stream_then_stop)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()
