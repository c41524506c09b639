"""A migrating `/v1/messages` stream. Its legs are chat completions — the request the replica's
own Messages endpoint makes of it (`protocol.anthropic_chat.chat_body`) — spliced like any chat
stream (stream_splice.py), and rendered here as the Messages API's events with the translation
the replica itself uses (`protocol.anthropic_stream.MessageEvents`), so a client reads the same
events, whichever replicas wrote them."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator

from gateway.resumable import Resumable, resumable
from protocol.anthropic import MessagesRequest
from protocol.anthropic_chat import chat_body
from protocol.anthropic_errors import stream_error
from protocol.anthropic_stream import MessageEvents
from protocol.chat import ChatCompletionChunk
from protocol.errors import APIError
from protocol.sse import DONE

CHAT_PATH = "/v1/chat/completions"


def resumable_messages(req: MessagesRequest, changes: dict) -> Resumable | None:
    """A streamed Messages request's migration: its legs ask for chat chunks with usage on each
    (what the translation reads); `changes`: the gateway's (tenant salt, priority)."""
    migrates = resumable({**chat_body(req, stream_usage=True), **changes}, 1, True,
                         bool(req.stream), include_usage=True)
    if migrates is None:
        return None
    migrates.path = CHAT_PATH

    def render(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        return message_events(chunks, req.model, req.stop_sequences)

    migrates.render = render
    return migrates


async def message_events(chunks: AsyncIterator[bytes], model: str,
                         stop_sequences: list[str] | None) -> AsyncIterator[bytes]:
    """Spliced chat chunks (whole SSE events) → the Messages API's events; an error event (the
    migration gave up) → Anthropic's error event."""
    events = MessageEvents(f"msg_{secrets.token_hex(12)}", model, stop_sequences)
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
                                            error.get("code")), "/v1/messages")
                return
            for out in events.feed(ChatCompletionChunk.model_validate(payload)):
                yield out
