"""Hermes / Qwen: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per
call, text allowed around them (Hermes 2/3, Qwen 2/2.5/3, SmolLM, and models without a template
of their own, which kvgate prompts in this format)."""

from __future__ import annotations

import json

from backend_engine.tool_parsers.base import (ParsedToolCall, Split, ToolParser, call_from,
                                              finish_content, safe_length)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (OPEN,)
    separator = "\n"

    def split(self, text: str, final: bool) -> Split:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        pos = 0
        while (start := text.find(OPEN, pos)) >= 0:
            end = text.find(CLOSE, start)
            if end < 0:
                break
            call = _parse_block(text[start + len(OPEN):end])
            if call is None:  # not a call after all: it stays text
                content.append(text[pos:end + len(CLOSE)])
            else:
                content.append(text[pos:start])
                calls.append(call)
            pos = end + len(CLOSE)
        rest = text[pos:]
        content.append(rest if final else rest[:safe_length(rest, self.markers)])
        return Split(finish_content("".join(content), calls, final), calls)

    def call_tag(self, name: str, parameters: dict) -> dict:
        return {"type": "tag", "begin": f'{OPEN}\n{{"name": "{name}", "arguments": ',
                "content": self.arguments_format(parameters), "end": f"}}\n{CLOSE}"}


def _parse_block(body: str) -> ParsedToolCall | None:
    try:
        return call_from(json.loads(body), ("arguments", "parameters"))
    except ValueError:
        return None
