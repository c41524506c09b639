"""Migrating streams of the APIs a replica renders from chat chunks — Anthropic's Messages
(`/v1/messages`) and OpenAI's Responses (`/v1/responses`). Their legs are the chat completions
the replica's own endpoint makes of them (`chat_body` in protocol/anthropic_chat.py and
protocol/responses.py), spliced like any chat stream (stream_splice.py), and rendered here into
the client's events by the translation the replica itself uses (protocol/anthropic_stream.py,
protocol/response_events.py): the client reads the same events, whichever replicas wrote them."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Protocol

from gateway.resumable import Resumable, resumable
from protocol.anthropic import MessagesRequest
from protocol.anthropic_chat import chat_body
from protocol.anthropic_errors import stream_error
from protocol.anthropic_stream import MessageEvents
from protocol.chat import ChatCompletionChunk
from protocol.errors import APIError
from protocol.response_events import ResponseEvents, response_skeleton
from protocol.responses import ResponsesRequest
from protocol.sse import DONE

CHAT_PATH = "/v1/chat/completions"


class Events(Protocol):
    def feed(self, chunk: ChatCompletionChunk) -> Iterator[bytes]: ...

    def close(self) -> Iterator[bytes]: ...


def resumable_rendered(req: MessagesRequest | ResponsesRequest, path: str,
                       changes: dict) -> Resumable | None:
    """A streamed Messages or Responses request's migration, when it may have one; `changes`:
    the gateway's to its body (tenant salt, priority)."""
    if isinstance(req, ResponsesRequest):
        if req.max_tool_calls is not None:  # a chat request cannot say it: no migration
            return None
        body = {**req.chat_body(), "stream_options": {"include_usage": True}}
    else:  # usage on every chunk: message_start reports the prompt's
        body = chat_body(req, stream_usage=True)
    migrates = resumable({**body, **changes}, 1, True, bool(req.stream), include_usage=True)
    if migrates is None:
        return None
    migrates.path = CHAT_PATH
    migrates.render = lambda chunks: rendered(chunks, _events(req), path)
    return migrates


def _events(req: MessagesRequest | ResponsesRequest) -> Events:
    if isinstance(req, MessagesRequest):
        return MessageEvents(f"msg_{secrets.token_hex(12)}", req.model, req.stop_sequences)
    response_id = f"resp-{req.request_id or secrets.token_hex(16)}"
    return ResponseEvents(response_skeleton(req, response_id, int(time.time()), req.model))


async def rendered(chunks: AsyncIterator[bytes], events: Events, path: str) -> AsyncIterator[bytes]:
    """Spliced chat chunks (whole SSE events) → the client's events; an error event (the
    migration gave up) → the API's own error event."""
    if isinstance(events, ResponseEvents):
        for out in events.start():
            yield out
    async for data in chunks:
        for frame in data.split(b"\n\n"):
            if not frame.startswith(b"data: "):
                continue
            if frame == DONE.rstrip():
                for out in events.close():
                    yield out
                return
            payload = json.loads(frame[6:])
            if "error" in payload:
                error = payload["error"]
                yield stream_error(APIError(502, error.get("message") or "upstream error",
                                            error.get("type") or "server_error", None,
                                            error.get("code")), path)
                return
            for out in events.feed(ChatCompletionChunk.model_validate(payload)):
                yield out
