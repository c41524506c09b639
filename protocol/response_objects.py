"""What `/v1/responses` returns: the response object with its output items (reasoning, a message
with its output text, function calls), usage, and the server-sent events of a streamed response."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from protocol.sse import sse_event

Status = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Status
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The model's reasoning (`--reasoning-parser`), before its message or calls."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Status


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int) -> "ResponseUsage":
        return cls(input_tokens=input_tokens, output_tokens=output_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
                   total_tokens=input_tokens + output_tokens)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    @property
    def output_text(self) -> str:
        return "".join(part.text for item in self.output if isinstance(item, OutputMessage)
                       for part in item.content)


class EventWriter:
    """Numbers a streamed response's events and frames each as `event: TYPE` + `data: {...}`."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, type_: str, **fields: Any) -> bytes:
        payload = {"type": type_, "sequence_number": self.sequence_number}
        for key, value in fields.items():
            payload[key] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        self.sequence_number += 1
        return sse_event(type_, payload)
