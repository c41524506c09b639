"""Chat completion chunks of one choice → the Messages API's stream: `message_start` and a `ping`,
then per content block `content_block_start`, its deltas (`text_delta`, `thinking_delta`,
`input_json_delta`) and `content_block_stop`, then `message_delta` (stop_reason, usage) and
`message_stop`. The chat stream must carry usage on its chunks (`continuous_usage_stats`), so
`message_start` can say how much of the prompt the prefix cache held."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from protocol.anthropic import MessageUsage
from protocol.anthropic_chat import reasoning_of, stop_reason
from protocol.chat import ChatCompletionChunk
from protocol.common import Usage
from protocol.sse import sse_event

_EMPTY_BLOCKS = {"text": {"type": "text", "text": ""},
                 "thinking": {"type": "thinking", "thinking": "", "signature": ""}}
_DELTA_FIELDS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}


def _usage(usage: Usage | None) -> MessageUsage:
    if usage is None:
        return MessageUsage(input_tokens=0, output_tokens=0)
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return MessageUsage.of(usage.prompt_tokens, usage.completion_tokens, cached)


class MessageEvents:
    """Feed it each chunk, then `close()` when the chat stream ends."""

    def __init__(self, message_id: str, model: str, stop_sequences: list[str] | None) -> None:
        self.message_id, self.model, self.stop_sequences = message_id, model, stop_sequences
        self.started = False
        self.index = -1  # the open (or last) content block
        self.open: str | None = None  # its type while open
        self.usage: Usage | None = None
        self.finish: tuple[str | None, str | int | None] = (None, None)

    def feed(self, chunk: ChatCompletionChunk) -> Iterator[bytes]:
        if chunk.usage is not None:
            self.usage = chunk.usage
        deltas = [c for c in chunk.choices if c.delta.role is None or c.delta.content]
        if not self.started and (self.usage is not None or deltas):
            yield from self._start()
        for choice in deltas:
            delta = choice.delta
            reasoning = reasoning_of(delta)
            if reasoning:
                yield from self._text("thinking", reasoning)
            if delta.content:
                yield from self._text("text", delta.content)
            for call in delta.tool_calls or []:
                if call.id is not None:
                    yield from self._open("tool_use", {"type": "tool_use", "id": call.id,
                                                       "name": call.function.name, "input": {}})
                if call.function.arguments:
                    yield self._delta({"type": "input_json_delta",
                                       "partial_json": call.function.arguments})
            if choice.finish_reason is not None:
                self.finish = (choice.finish_reason, choice.stop_reason)

    def close(self) -> Iterator[bytes]:
        if not self.started:
            yield from self._start()
        yield from self._close_block()
        reason, sequence = stop_reason(*self.finish, self.stop_sequences)
        yield sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": _usage(self.usage).model_dump()})
        yield sse_event("message_stop", {"type": "message_stop"})

    def _start(self) -> Iterator[bytes]:
        self.started = True
        yield sse_event("message_start", {"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": _usage(self.usage).model_dump()}})
        yield sse_event("ping", {"type": "ping"})

    def _text(self, kind: str, text: str) -> Iterator[bytes]:
        if self.open != kind:
            yield from self._open(kind, _EMPTY_BLOCKS[kind])
        delta_type, field = _DELTA_FIELDS[kind]
        yield self._delta({"type": delta_type, field: text})

    def _open(self, kind: str, block: dict[str, Any]) -> Iterator[bytes]:
        yield from self._close_block()
        self.index += 1
        self.open = kind
        yield sse_event("content_block_start", {"type": "content_block_start",
                                                "index": self.index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta",
                                                 "index": self.index, "delta": delta})

    def _close_block(self) -> Iterator[bytes]:
        if self.open is not None:
            self.open = None
            yield sse_event("content_block_stop", {"type": "content_block_stop",
                                                   "index": self.index})
