"""Pieces the chat and completions protocols share: OpenAI's limits, the sampling fields (OpenAI's
plus vLLM's extras), stream options and usage."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from protocol.engine_extras import split_extras
from protocol.errors import bad_request
from protocol.kv_transfer import KVTransferParams

MAX_N = 128
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_LOGIT_BIAS = 100.0
MAX_METADATA_PAIRS = 16
# vLLM's request priority: lower is served earlier, 0 by default; bounded to int32 at the edge
MIN_PRIORITY = -(2**31)
MAX_PRIORITY = 2**31 - 1


class StrictModel(BaseModel):
    """Request objects: unknown fields are an error, types are not coerced ("5" is not 5)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TokenIdsChoice(BaseModel):
    """A choice that may carry its generated token ids (vLLM's `return_token_ids`): all of them
    in a response, the new ones in a stream chunk. Absent unless asked for."""

    token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_token_ids(self, handler) -> dict[str, Any]:  # noqa: ANN001
        data = handler(self)
        if data.get("token_ids") is None:
            data.pop("token_ids", None)
        return data


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # accepted; we never add obfuscation padding
    continuous_usage_stats: bool | None = False  # vLLM: usage on every chunk


class SamplingFields(StrictModel):
    """Fields every generation request carries."""

    model: str = Field(min_length=1)
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # int64, as OpenAI
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    cache_salt: str | None = Field(default=None, min_length=1)
    request_id: str | None = Field(default=None, min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:-]+$")
    priority: int | None = Field(default=None, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    kv_transfer_params: KVTransferParams | None = None  # set by the gateway (P/D halves)
    # vLLM: each choice (each stream chunk's) carries the ids of its generated tokens
    return_token_ids: bool | None = False
    # kvgate: output tokens another replica already generated (and streamed) for this request;
    # generation goes on after them as if sampled here (the gateway's mid-stream migration)
    resume_token_ids: list[int] | None = Field(default=None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _engine_extras(cls, data: Any) -> Any:
        return split_extras(cls.model_fields, data)  # vLLM's and SGLang's extras (engine_extras.py)

    @model_validator(mode="after")
    def _check_shared(self) -> Any:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise bad_request(f"'stop' accepts at most {MAX_STOP} sequences, got {len(self.stop)}.", "stop", "invalid_value")
        if self.stream_options is not None and not self.stream:
            raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options", "invalid_value")
        for key, bias in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise bad_request(f"Invalid key in 'logit_bias': {key!r} is not a token id.", "logit_bias", "invalid_value")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise bad_request(f"Invalid 'logit_bias' for token {key}: must be in [-100, 100].", "logit_bias", "invalid_value")
        if self.stop_token_ids and any(t < 0 for t in self.stop_token_ids):
            raise bad_request("'stop_token_ids' must be non-negative token ids.", "stop_token_ids", "invalid_value")
        if self.resume_token_ids is not None:
            if (self.n or 1) != 1:
                raise bad_request("'resume_token_ids' continues one sample: 'n' must be 1.", "resume_token_ids", "invalid_value")
            if any(t < 0 for t in self.resume_token_ids):
                raise bad_request("'resume_token_ids' must be non-negative token ids.", "resume_token_ids", "invalid_value")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )
