"""`POST /v1/completions` (legacy text completions): request, response and stream chunks."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from protocol.common import MAX_COMPLETION_LOGPROBS, SamplingFields, TokenIdsChoice, Usage
from protocol.errors import bad_request, unsupported
from protocol.structured import ResponseFormat, StructuredOutputs

Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    metadata: dict[str, str] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    add_special_tokens: bool | None = True
    response_format: ResponseFormat | None = None  # vLLM extra, as in chat
    structured_outputs: StructuredOutputs | None = None  # vLLM extra

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion)")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise unsupported("best_of", "best_of different from n")
        if self.response_format is not None and self.response_format.type != "text" \
                and self.structured_outputs is not None and self.structured_outputs.has_constraint:
            raise bad_request("Give either 'response_format' or 'structured_outputs', not both.",
                              "structured_outputs", "invalid_value")
        prompts = self.prompt
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(prompts, list) and len(prompts) == 0:
            raise bad_request("'prompt' must not be empty.", "prompt", "invalid_value")
        for i, p in enumerate(prompts):
            if isinstance(p, list) and not p:
                raise bad_request(f"'prompt[{i}]' must not be empty.", f"prompt[{i}]", "invalid_value")
            if isinstance(p, int) and p < 0 or isinstance(p, list) and any(t < 0 for t in p):
                raise bad_request("Token ids in 'prompt' must be non-negative.", "prompt", "invalid_value")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each a string or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class LegacyLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(TokenIdsChoice):
    index: int
    text: str
    logprobs: LegacyLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class Completion(BaseModel):
    """Both the response and a stream chunk (OpenAI uses "text_completion" for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None
