"""`POST /tokenize` and `POST /detokenize`, with vLLM's bodies: tokenize either a prompt or a
chat conversation rendered through the model's template."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_validator

from protocol.chat import ChatMessage
from protocol.common import StrictModel
from protocol.errors import bad_request


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("Give exactly one of 'prompt' or 'messages'.", "prompt", "invalid_value")
        if self.messages is not None and not self.messages:
            raise bad_request("'messages' must not be empty.", "messages", "invalid_value")
        for i, message in enumerate(self.messages or []):
            message.text(f"messages[{i}]")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict(i) for i, m in enumerate(self.messages or [])]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)

    @model_validator(mode="after")
    def _non_negative(self) -> "DetokenizeRequest":
        if any(t < 0 for t in self.tokens):
            raise bad_request("Token ids must be non-negative.", "tokens", "invalid_value")
        return self


class DetokenizeResponse(BaseModel):
    prompt: str
