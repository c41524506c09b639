"""`POST /v1/responses` (OpenAI's Responses API) as a request, and its translation into the chat
completion both edges already render, tokenise and route: `instructions` become the system
message, input items the conversation (function calls and their outputs included), flat
function tools the chat tools, and `text.format` the response format.

Nothing is stored: `store` is false by default and `true` is refused, as is
`previous_response_id` — send the conversation in `input`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from protocol.chat import ChatCompletionRequest
from protocol.common import MAX_PRIORITY, MIN_PRIORITY, StrictModel
from protocol.errors import bad_request, unsupported
from protocol.parsing import parse_request, validation_error_to_api_error
from protocol.structured import check_json_schema
from protocol.tools import FUNCTION_NAME, check_tools


class LenientModel(BaseModel):
    """Input items a client sends back as it received them (ids, status, annotations)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(LenientModel):
    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(LenientModel):
    type: str | None = None  # "message" when absent
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class FormatText(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class TextConfig(StrictModel):
    format: FormatText | None = None
    verbosity: str | None = None


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


class ResponsesRequest(StrictModel):
    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    store: bool | None = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # kvgate / vLLM extras, as on the chat endpoint
    cache_salt: str | None = Field(default=None, min_length=1)
    request_id: str | None = Field(default=None, min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:-]+$")
    priority: int | None = Field(default=None, ge=MIN_PRIORITY, le=MAX_PRIORITY)

    @model_validator(mode="after")
    def _check(self) -> "ResponsesRequest":
        if self.store:
            raise unsupported("store", "Storing responses")
        if self.previous_response_id is not None:
            raise unsupported("previous_response_id", "previous_response_id (responses are not "
                              "stored; send the conversation in 'input')")
        for field in ("background", "conversation", "prompt"):
            if getattr(self, field):
                raise unsupported(field, f"'{field}'")
        if self.top_logprobs:
            raise unsupported("top_logprobs", "Logprobs on /v1/responses")
        if isinstance(self.input, list) and not self.input:
            raise bad_request("'input' must not be empty.", "input", "invalid_value")
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.name is None:
                raise bad_request("Missing required parameter: 'text.format.name'.",
                                  "text.format.name", "missing_required_parameter")
            check_json_schema(fmt.json_schema or {}, "text.format.schema")
        check_tools(self.functions, self.tool_choice_name, nested=False)
        return self

    @property
    def n(self) -> int:
        return 1

    @property
    def functions(self) -> list[FunctionTool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise unsupported(f"tools[{i}].type", f"Tool type '{tool.get('type')}'")
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValidationError as exc:
                error = validation_error_to_api_error(exc)
                error.param = f"tools[{i}].{error.param}" if error.param else f"tools[{i}]"
                error.message = f"Invalid tool definition at '{error.param}': {error.message}"
                raise error from None
        return tools

    @property
    def tool_choice_name(self) -> str:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            return choice.name
        return choice or ("auto" if self.tools else "none")

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages (OpenAI's wire shape)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.type or "message"
            if kind == "message":
                messages.append({"role": _role(item, i), "content": _text(item.content, i)})
            elif kind == "function_call":
                call = {"id": _required(item.call_id, i, "call_id"), "type": "function",
                        "function": {"name": _required(item.name, i, "name"),
                                     "arguments": item.arguments or "{}"}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and \
                        (last.get("tool_calls") or _item_before_is_message(self.input, i)):
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": _required(item.call_id, i, "call_id"),
                                 "content": _text(item.output, i, "output")})
            elif kind == "reasoning":
                continue  # the model's own summary of its reasoning: nothing to render
            else:
                raise unsupported(f"input[{i}].type", f"Input item type '{kind}'")
        return messages

    def to_chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion (validated as one)."""
        return parse_request(ChatCompletionRequest, self.chat_body())

    def chat_body(self) -> dict[str, Any]:
        """`to_chat`'s request as the JSON body of a chat completion (not yet validated)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(),
                                "stream": bool(self.stream)}
        optional = {"max_completion_tokens": self.max_output_tokens,
                    "temperature": self.temperature, "top_p": self.top_p,
                    "parallel_tool_calls": self.parallel_tool_calls,
                    "cache_salt": self.cache_salt, "request_id": self.request_id,
                    "priority": self.priority}
        body.update({k: v for k, v in optional.items() if v is not None})
        if self.tools:
            body["tools"] = [{"type": "function", "function": {k: v for k, v in t.model_dump(
                exclude_none=True).items() if k != "type"}} for t in self.functions]
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else \
                {"type": "function", "function": {"name": choice.name}}
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
                "type": "json_schema", "json_schema": fmt.model_dump(
                    by_alias=True, exclude_none=True, exclude={"type"})}
        return body


def _item_before_is_message(items: list[InputItem], i: int) -> bool:
    return i > 0 and (items[i - 1].type or "message") == "message" and items[i - 1].role == "assistant"


def _role(item: InputItem, i: int) -> str:
    if item.role is None:
        raise bad_request(f"Missing required parameter: 'input[{i}].role'.", f"input[{i}].role",
                          "missing_required_parameter")
    return item.role


def _required(value: str | None, i: int, field: str) -> str:
    if not value:
        raise bad_request(f"Missing required parameter: 'input[{i}].{field}'.",
                          f"input[{i}].{field}", "missing_required_parameter")
    return value


def _text(content: str | list[ContentPart] | None, i: int, field: str = "content") -> str:
    if content is None:
        raise bad_request(f"Missing required parameter: 'input[{i}].{field}'.",
                          f"input[{i}].{field}", "missing_required_parameter")
    if isinstance(content, str):
        return content
    pieces = []
    for j, part in enumerate(content):
        if part.type in ("input_text", "output_text", "text") and part.text is not None:
            pieces.append(part.text)
        elif part.type == "refusal":
            pieces.append(part.refusal or "")
        else:
            raise unsupported(f"input[{i}].{field}[{j}].type", f"Content part type '{part.type}'")
    return "".join(pieces)
