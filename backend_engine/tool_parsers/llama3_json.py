"""Llama 3.1/3.2 JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}` (after
an optional `<|python_tag|>`), several separated by `;`. A reply that does not start so is
content."""

from __future__ import annotations

import json

from backend_engine.tool_parsers.base import (ParsedToolCall, Split, ToolParser, call_from,
                                              finish_content)

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG, "{")
    separator = "; "
    needs_special_tokens = True  # <|python_tag|> is one

    def split(self, text: str, final: bool) -> Split:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
            if not body:  # the tag alone: a call may follow
                return Split(text if final else "")
        elif not body or PYTHON_TAG.startswith(body):
            return Split(text if final else "")  # may still become the tag
        if not body.startswith("{"):
            return Split(text)
        calls: list[ParsedToolCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = _DECODER.raw_decode(body, pos)
            except ValueError:
                break
            call = call_from(obj, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        if not final:
            return Split("", calls)
        if not calls:
            return Split(text)
        return Split(finish_content(body[pos:], calls, True), calls)

    def call_tag(self, name: str, parameters: dict) -> dict:
        return {"type": "tag", "begin": f'{{"name": "{name}", "parameters": ',
                "content": self.arguments_format(parameters), "end": "}"}
