"""Function tools at the HTTP edge (chat completions' nested shape), the tool calls an assistant
message carries and their streamed deltas, and the checks both edges run on tool definitions."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from protocol.common import StrictModel
from protocol.errors import bad_request, unsupported
from protocol.structured import check_json_schema

FUNCTION_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"
MAX_TOOLS = 128


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(StrictModel):
    type: str  # only "function" is served; others are refused by check_chat_tools, by index
    function: FunctionDefinition | None = None


class NamedFunction(StrictModel):
    name: str = Field(min_length=1)


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tools(tools: list, choice: str | None, nested: bool = True) -> None:
    """Bad tool definitions and a tool_choice that names no tool: 400 naming the field.
    `choice` is "none" | "auto" | "required" | a function name; `nested`: chat's shape
    (`tools[i].function.parameters`), else the Responses API's flat one."""
    param, choice_param = "tools", "tool_choice"
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'{param}' holds at most {MAX_TOOLS} tools.", param, "invalid_value")
    seen: set[str] = set()
    for i, function in enumerate(tools):
        if function.name in seen:
            raise bad_request(f"Duplicate function name '{function.name}' in '{param}'.",
                              f"{param}[{i}]", "invalid_value")
        seen.add(function.name)
        if function.parameters is not None:
            where = f"{param}[{i}].function.parameters" if nested else f"{param}[{i}].parameters"
            check_json_schema(function.parameters, where)
            kind = function.parameters.get("type", "object")
            if kind != "object":
                raise bad_request(f"'{where}' must describe an object (type 'object').",
                                  f"{where}.type", "invalid_value")
    if choice in ("required",) and not tools:
        raise bad_request(f"'{choice_param}' is 'required' but no tools are given.",
                          choice_param, "invalid_value")
    if choice not in (None, "none", "auto", "required") and choice not in seen:
        raise bad_request(f"'{choice_param}' names function '{choice}', which is not in "
                          f"'{param}'.", choice_param, "invalid_value")


def check_chat_tools(tools: list[ChatTool]) -> list[FunctionDefinition]:
    """The functions of chat's `tools`; 400 naming the tool that is not a function."""
    functions = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise unsupported(f"tools[{i}].type", f"Tool type '{tool.type}'")
        if tool.function is None:
            raise bad_request(f"Missing required parameter: 'tools[{i}].function'.",
                              f"tools[{i}].function", "missing_required_parameter")
        functions.append(tool.function)
    return functions


def choice_name(choice: ToolChoice | None) -> str | None:
    """tool_choice as "none" | "auto" | "required" | the named function, None if absent."""
    if isinstance(choice, NamedToolChoice):
        return choice.function.name
    return choice


def check_legacy_functions(functions: Any, function_call: Any) -> None:
    if functions or function_call not in (None, "none"):
        raise unsupported("functions" if functions else "function_call",
                          "The deprecated 'functions' API (use 'tools')")


def template_tool_calls(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls of an assistant message as chat templates read them: `arguments` as a dict
    (OpenAI sends a JSON string), as transformers and vLLM hand them over."""
    out = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        out.append(call)
    return out


# ---- what the assistant returns --------------------------------------------------------------


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="plain")
    def _drop_unset(self) -> dict[str, Any]:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments))
                if v is not None}


class DeltaToolCall(BaseModel):
    """One streamed piece of a tool call: index, id, type and name first, then arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler) -> dict[str, Any]:  # noqa: ANN001
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None}
