"""Mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (v3
tokenizers), or `[TOOL_CALLS]name[ARGS]{...}` per call (v11 and later)."""

from __future__ import annotations

import json

from backend_engine.tool_parsers.base import (ParsedToolCall, Split, ToolParser, call_from,
                                              finish_content, safe_length)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_DECODER = json.JSONDecoder()


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)
    separator = ", "
    needs_special_tokens = True  # [TOOL_CALLS] is a control token

    def split(self, text: str, final: bool) -> Split:
        at = text.find(TOOL_CALLS)
        if at < 0:
            content = text if final else text[:safe_length(text, self.markers)]
            return Split(finish_content(content, [], final))
        before, rest = text[:at], text[at + len(TOOL_CALLS):]
        calls, used = (_json_list if rest.lstrip().startswith("[") else _named)(rest)
        if not final:
            return Split(finish_content(before, calls, False), calls)
        if not calls:
            return Split(text)
        return Split(finish_content(before + rest[used:], calls, True), calls)

    def call_tag(self, name: str, parameters: dict) -> dict:
        return {"type": "tag", "begin": f'{{"name": "{name}", "arguments": ',
                "content": self.arguments_format(parameters), "end": "}"}

    def wrap(self, calls_format: dict) -> dict:
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": f"{TOOL_CALLS}["}, calls_format,
            {"type": "const_string", "value": "]"}]}


def _json_list(rest: str) -> tuple[list[ParsedToolCall], int]:
    start = len(rest) - len(rest.lstrip())
    try:
        items, end = _DECODER.raw_decode(rest, start)
    except ValueError:
        return [], 0  # not complete yet (or not JSON)
    calls = [call_from(item, ("arguments", "parameters")) for item in items] \
        if isinstance(items, list) else [None]
    if not calls or None in calls:
        return [], 0
    return calls, end


def _named(rest: str) -> tuple[list[ParsedToolCall], int]:
    calls: list[ParsedToolCall] = []
    pos = used = 0
    while (args := rest.find(ARGS, pos)) >= 0:
        name = rest[pos:args].strip()
        try:
            arguments, end = _DECODER.raw_decode(rest, args + len(ARGS))
        except ValueError:
            break
        call = call_from({"name": name, "arguments": arguments}, ("arguments",))
        if call is None or not name.replace("_", "").replace("-", "").replace(".", "").isalnum():
            break
        calls.append(call)
        used = pos = end
        if rest.startswith(TOOL_CALLS, pos):
            pos += len(TOOL_CALLS)
    return calls, used
