"""How a chat request's tools shape its generation and its answer: which grammar forces calls
("required" or a named function, in the model family's own format), what the parser reads back
("auto"), and the tool calls, content and finish reason of each choice."""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

from backend_engine.structured import StructuredOutputsParams
from backend_engine.tool_parsers import ParsedToolCall, ToolParser
from backend_engine.tool_parsers.stream import ToolCallStream
from protocol.errors import bad_request
from protocol.tools import FunctionCall, FunctionDefinition, ToolCall


@dataclass(slots=True)
class ToolPlan:
    parser: ToolParser | None  # None: the reply is plain content (no tools, or choice "none")
    choice: str  # "none" | "auto" | "required" | a function name
    parallel: bool
    structured: StructuredOutputsParams | None  # the grammar forcing calls, if any
    max_calls: int | None = None  # calls returned at most (None: all)

    @classmethod
    def build(cls, functions: list[FunctionDefinition], choice: str, parallel: bool | None,
              parser: ToolParser, content_schema: dict | None,
              constraint: StructuredOutputsParams | None,
              disable_any_whitespace: bool = True) -> "ToolPlan":
        """`content_schema`: a JSON response format; `constraint`: the request's own one;
        `disable_any_whitespace`: the JSON whitespace policy of forced calls' arguments."""
        parallel = parallel is not False
        plan = cls._build(functions, choice, parallel, parser, content_schema, constraint,
                          disable_any_whitespace)
        return plan if parallel else dataclasses.replace(plan, max_calls=1)

    @classmethod
    def _build(cls, functions: list[FunctionDefinition], choice: str, parallel: bool,
               parser: ToolParser, content_schema: dict | None,
               constraint: StructuredOutputsParams | None, compact: bool) -> "ToolPlan":
        if not functions or choice == "none":
            return cls(None, "none", parallel, constraint)
        if constraint is not None and content_schema is None:
            raise bad_request("'structured_outputs' cannot be combined with tool calls; use "
                              "'response_format' or tool_choice 'none'.", "structured_outputs",
                              "invalid_value")
        signatures = [(f.name, f.parameters or {"type": "object"}) for f in functions]
        if choice == "auto":
            if content_schema is None:
                return cls(parser, choice, parallel, None)  # free text, parsed afterwards
            tag = parser.auto_format(signatures, content_schema)
        else:
            tag = parser.forced_format(signatures, choice, parallel)
        return cls(parser, choice, parallel,
                   StructuredOutputsParams(structural_tag=tag, param="tools",
                                           disable_any_whitespace=compact))

    @property
    def skip_special_tokens_off(self) -> bool:
        """The parser reads markers that are special tokens: detokenise them."""
        return self.parser is not None and self.parser.needs_special_tokens

    def stream(self) -> ToolCallStream | None:
        return ToolCallStream(self.parser) if self.parser is not None else None

    def keep(self, calls: list[ParsedToolCall], already: int = 0) -> list[ParsedToolCall]:
        """Calls to return, given `already` returned (at most max_calls in all)."""
        return calls if self.max_calls is None else calls[:max(0, self.max_calls - already)]

    def answer(self, text: str, finish_reason: str | None
               ) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool calls, finish reason) of a finished choice."""
        if self.parser is None:
            return text, [], finish_reason
        split = self.parser.split(text, final=True)
        calls = [tool_call(c) for c in self.keep(split.calls)]
        return split.content, calls, tool_finish_reason(calls, finish_reason)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tool_call(call: ParsedToolCall, call_id: str | None = None) -> ToolCall:
    return ToolCall(id=call_id or new_call_id(),
                    function=FunctionCall(name=call.name, arguments=call.arguments))


def tool_finish_reason(calls: list, finish_reason: str | None) -> str | None:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason
