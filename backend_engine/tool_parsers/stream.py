"""Streaming a reply that may hold tool calls: content as soon as it can no longer become part
of a call, each call whole once it is complete (never half-parsed), and at the end exactly what
the non-streamed reply holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend_engine.tool_parsers.base import ParsedToolCall, Split, ToolParser


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)


class ToolCallStream:
    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = ""
        self.num_sent_calls = 0

    def feed(self, delta_text: str, final: bool = False) -> StreamDelta:
        self.text += delta_text
        split = self.parser.split(self.text, final)
        return self._diff(split)

    def _diff(self, split: Split) -> StreamDelta:
        content = split.content or ""
        if content.startswith(self.sent_content):
            new_content = content[len(self.sent_content):]
        else:  # cannot happen for a consistent parser; never resend what was sent
            new_content = ""
        self.sent_content += new_content
        out = StreamDelta(new_content, split.calls[self.num_sent_calls:])
        self.num_sent_calls = max(self.num_sent_calls, len(split.calls))
        return out
