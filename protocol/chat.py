"""`POST /v1/chat/completions`: the request with OpenAI's rules, the response and stream chunks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from protocol.common import MAX_METADATA_PAIRS, MAX_TOP_LOGPROBS, SamplingFields, TokenIdsChoice, Usage
from protocol.errors import bad_request, unsupported
from protocol.structured import ResponseFormat, StructuredOutputs
from protocol.tools import (ChatTool, DeltaToolCall, FunctionDefinition, ToolCall,
                            ToolChoice, check_chat_tools, check_legacy_functions,
                            check_tools, choice_name, template_tool_calls)

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ContentPart(BaseModel):
    """A content part; only text (and an assistant's refusal) can reach a text-only model."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None
    refusal: str | None = None


class ChatMessage(BaseModel):
    # Lenient on extra keys (clients echo back fields such as `reasoning_content`); they are dropped.
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    def text(self, param: str) -> str | None:
        """The content as one string; refuses non-text parts with `param` naming the part."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            if part.type == "text" and part.text is not None:
                pieces.append(part.text)
            elif part.type == "refusal" and self.role == "assistant":
                pieces.append(part.refusal or "")
            else:
                raise unsupported(f"{param}.content[{j}].type", f"Content part type '{part.type}'")
        return "".join(pieces)

    def to_template_dict(self, index: int) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text(f"messages[{index}]") or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                out[key] = template_tool_calls(value) if key == "tool_calls" else value
        return out


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM extra
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # vLLM chat-template extras
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool | None = True  # vLLM: false leaves the reasoning out of the answer

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs", "invalid_value")
        check_tools(check_chat_tools(self.tools or []), choice_name(self.tool_choice))
        check_legacy_functions(self.functions, self.function_call)
        if self.response_format is not None and self.response_format.type != "text" \
                and self.structured_outputs is not None and self.structured_outputs.has_constraint:
            raise bad_request("Give either 'response_format' or 'structured_outputs', not both.",
                              "structured_outputs", "invalid_value")
        if self.modalities and any(m != "text" for m in self.modalities):
            raise unsupported("modalities", "Output modalities other than text")
        if self.audio is not None:
            raise unsupported("audio", "Audio output")
        if self.web_search_options is not None:
            raise unsupported("web_search_options", "Web search")
        if self.prediction is not None:
            raise unsupported("prediction", "Predicted outputs")
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise bad_request(
                "'continue_final_message' needs a final assistant message and 'add_generation_prompt': false.",
                "continue_final_message", "invalid_value")
        if self.metadata is not None and len(self.metadata) > MAX_METADATA_PAIRS:
            raise bad_request(f"'metadata' holds at most {MAX_METADATA_PAIRS} pairs.", "metadata", "invalid_value")
        for i, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":
                raise bad_request(f"Missing required parameter: 'messages[{i}].content'.", f"messages[{i}].content", "missing_required_parameter")
            if message.role == "tool" and not message.tool_call_id:
                raise bad_request(f"Missing required parameter: 'messages[{i}].tool_call_id'.", f"messages[{i}].tool_call_id", "missing_required_parameter")
            message.text(f"messages[{i}]")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per sampled token, or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict(i) for i, m in enumerate(self.messages)]

    @property
    def tool_functions(self) -> list[FunctionDefinition]:
        return [t.function for t in self.tools or [] if t.function is not None]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (None: no tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def tool_choice_name(self) -> str:
        """"none" | "auto" | "required" | a function's name; OpenAI's default for the tools."""
        return choice_name(self.tool_choice) or ("auto" if self.tools else "none")


# ---- responses -----------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None
    refusal: list[TokenLogprobEntry] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # vLLM's and SGLang's reasoning output (--reasoning-parser): the same text in both fields,
    # `reasoning` being vLLM's newer name
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(TokenIdsChoice):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None  # vLLM extra: the stop string or token id that matched


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler) -> dict[str, Any]:  # noqa: ANN001
        # OpenAI sends `{"role":"assistant","content":""}`, then `{"content":"…"}` (or
        # `{"tool_calls":[…]}`), then `{}`.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(TokenIdsChoice):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
