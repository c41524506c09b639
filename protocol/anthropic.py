"""`POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic's Messages API): the request,
its content blocks and tools, and the message it answers with. protocol/anthropic_chat.py turns
a request into the chat completion both edges already render, tokenise and route.

Unknown request fields are ignored, as Anthropic-compatible servers (vLLM, LiteLLM) do, so
agents that send newer fields keep working; every field named here is served or refused."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.common import MAX_PRIORITY, MIN_PRIORITY
from protocol.errors import bad_request, unsupported
from protocol.tools import FUNCTION_NAME


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ResultPart(Lenient):
    """A block inside a tool_result: text (images are refused, as everywhere)."""

    type: str
    text: str | None = None
    cache_control: dict[str, Any] | None = None


class ContentBlock(Lenient):
    """One content block of a message; which fields it needs depends on `type` (checked in
    `check_block`). `cache_control` is accepted on any block (see docs/api/anthropic.md)."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[ResultPart] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking
    signature: str | None = None  # thinking
    data: str | None = None  # redacted_thinking
    cache_control: dict[str, Any] | None = None


_REQUIRED = {"text": ("text",), "tool_use": ("id", "name", "input"),
             "tool_result": ("tool_use_id",), "thinking": ("thinking",),
             "redacted_thinking": ("data",)}
_ROLE_BLOCKS = {"user": {"text", "tool_result"},
                "assistant": {"text", "tool_use", "thinking", "redacted_thinking"}}
_MEDIA = {"image", "document", "search_result"}


def check_block(block: ContentBlock, role: str, where: str) -> None:
    """400 naming the block when it cannot be served or misses a field its type needs."""
    if block.type in _MEDIA:
        raise unsupported(f"{where}.type", f"A '{block.type}' content block (kvgate serves "
                                           "text-only models)")
    if block.type not in _REQUIRED:
        raise unsupported(f"{where}.type", f"Content block type '{block.type}'")
    if block.type not in _ROLE_BLOCKS[role]:
        raise bad_request(f"A '{block.type}' block may not appear in a {role} message.",
                          f"{where}.type", "invalid_value")
    for name in _REQUIRED[block.type]:
        if getattr(block, name) is None:
            raise bad_request(f"Missing required parameter: '{where}.{name}'.",
                              f"{where}.{name}", "missing_required_parameter")
    if block.type == "tool_result" and isinstance(block.content, list):
        for j, part in enumerate(block.content):
            where_part = f"{where}.content[{j}]"
            if part.type != "text":
                what = f"A '{part.type}' block inside a tool_result"
                raise unsupported(f"{where_part}.type", what + (" (kvgate serves text-only models)"
                                                                 if part.type in _MEDIA else ""))
            if part.text is None:
                raise bad_request(f"Missing required parameter: '{where_part}.text'.",
                                  f"{where_part}.text", "missing_required_parameter")


class InputMessage(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def blocks(self) -> list[ContentBlock]:
        if isinstance(self.content, str):
            return [ContentBlock(type="text", text=self.content)]
        return self.content


class SystemBlock(Lenient):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None


class Tool(Lenient):
    """A client tool. Server tools (web search, code execution…) carry another `type`."""

    type: str | None = None
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class MessagesBase(Lenient):
    """What a prompt is made of: the fields `count_tokens` and `messages` share."""

    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[SystemBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> "MessagesBase":
        for i, message in enumerate(self.messages):
            if isinstance(message.content, list):
                for j, block in enumerate(message.content):
                    check_block(block, message.role, f"messages[{i}].content[{j}]")
        for i, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                raise unsupported(f"tools[{i}].type", f"Server tool '{tool.type}'")
            if tool.input_schema is None:
                raise bad_request(f"Missing required parameter: 'tools[{i}].input_schema'.",
                                  f"tools[{i}].input_schema", "missing_required_parameter")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and not choice.name:
            raise bad_request("Missing required parameter: 'tool_choice.name'.",
                              "tool_choice.name", "missing_required_parameter")
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise bad_request(f"'tool_choice' is '{choice.type}' but no tools are given.",
                              "tool_choice", "invalid_value")
        return self


class MessagesRequest(MessagesBase):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None  # accepted: every request is served alike
    # kvgate / vLLM extras, as on the chat endpoint
    cache_salt: str | None = Field(default=None, min_length=1)
    request_id: str | None = Field(default=None, min_length=1, max_length=256,
                                   pattern=r"^[A-Za-z0-9._:-]+$")
    priority: int | None = Field(default=None, ge=MIN_PRIORITY, le=MAX_PRIORITY)

    @model_validator(mode="after")
    def _check_sampling(self) -> "MessagesRequest":
        user_id = (self.metadata or {}).get("user_id")
        if user_id is not None and not isinstance(user_id, str):
            raise bad_request("'metadata.user_id' must be a string.", "metadata.user_id",
                              "invalid_value")
        if any(s == "" for s in self.stop_sequences or []):
            raise bad_request("'stop_sequences' may not hold an empty string.", "stop_sequences",
                              "invalid_value")
        return self


class CountTokensRequest(MessagesBase):
    pass


class CountTokensResponse(BaseModel):
    input_tokens: int


# ---- the answer ------------------------------------------------------------------------------


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # kvgate's reasoning is not signed


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    """Anthropic's counts: `input_tokens` are the prompt tokens *not* read from the prefix
    cache; the prompt is input + cache_creation + cache_read."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> "MessageUsage":
        return cls(input_tokens=prompt_tokens - cached_tokens, output_tokens=output_tokens,
                   cache_read_input_tokens=cached_tokens)


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock | ThinkingBlock | ToolUseBlock] = Field(default_factory=list)
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage
