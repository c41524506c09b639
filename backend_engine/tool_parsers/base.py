"""What every tool-call parser shares: the parsed call, the split of a model's text into content
and complete calls (final, or safe-so-far while streaming), and the grammar that forces calls in
the parser's own format (an xgrammar structural tag) for tool_choice "required" or a name."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(slots=True, frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(slots=True)
class Split:
    content: str | None
    calls: list[ParsedToolCall] = field(default_factory=list)


def call_from(obj: Any, argument_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """{"name": ..., <argument key>: {...}} as a call; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(arguments, str):  # some models send the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def safe_length(text: str, markers: tuple[str, ...]) -> int:
    """How much of `text` cannot be part of a call yet: up to the first marker, or to a tail
    that could still grow into one."""
    cut = len(text)
    for marker in markers:
        at = text.find(marker)
        if at >= 0:
            cut = min(cut, at)
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


def finish_content(content: str, calls: list, final: bool) -> str | None:
    """Content beside calls loses its trailing blank; while streaming, blanks wait (they may
    only separate calls) and so does content that is blank so far."""
    if not final:
        content = content.rstrip()
        return content if content.strip() else ""
    if calls:
        content = content.rstrip()
        return content if content.strip() else None
    return content


class ToolParser:
    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]  # text that opens a tool call
    separator: ClassVar[str]  # between forced calls
    needs_special_tokens: ClassVar[bool] = False  # its markers are special tokens

    def split(self, text: str, final: bool) -> Split:
        """Content and the complete calls in `text`. Not final: only what can no longer change
        (content stops before anything that may still become a call)."""
        raise NotImplementedError

    def call_tag(self, name: str, parameters: dict) -> dict:
        """One call of `name` in this format, its arguments constrained by `parameters`."""
        raise NotImplementedError

    def wrap(self, calls_format: dict) -> dict:
        """The format around the calls (most formats have none)."""
        return calls_format

    def forced_format(self, functions: list[tuple[str, dict]], choice: str,
                      parallel: bool = True) -> dict:
        """The structural tag forcing calls: one of `choice` (a function name), or at least one
        of any function for "required" (exactly one unless `parallel`)."""
        if choice != "required":
            parameters = next(p for n, p in functions if n == choice)
            return self.structural_tag(self.wrap(self.call_tag(choice, parameters)))
        tags = [self.call_tag(n, p) for n, p in functions]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                 "at_least_one": True, "stop_after_first": not parallel}
        return self.structural_tag(self.wrap(calls))

    def auto_format(self, functions: list[tuple[str, dict]], content_schema: dict) -> dict:
        """Either content matching `content_schema` or calls (tool_choice auto together with a
        JSON response format)."""
        calls = self.forced_format(functions, "required")["format"]
        content = {"type": "json_schema", "json_schema": content_schema}
        return self.structural_tag({"type": "or", "elements": [content, calls]})

    @staticmethod
    def structural_tag(fmt: dict) -> dict:
        return {"type": "structural_tag", "format": fmt}

    @staticmethod
    def arguments_format(parameters: dict) -> dict:
        return {"type": "json_schema", "json_schema": parameters or {"type": "object"}}
