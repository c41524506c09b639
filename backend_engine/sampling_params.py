"""Per-request sampling parameters (vLLM-compatible names), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend_engine.errors import InvalidRequestError
from backend_engine.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 16


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per sampled token (0: just the token's)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding
    # output tokens generated elsewhere (a migrated stream): replayed as if sampled here, then
    # generation goes on; they count against max_tokens and in the usage's completion tokens
    resume_token_ids: list[int] = field(default_factory=list)
    # the output opens with reasoning: structured outputs apply once this text (the end of the
    # reasoning, "</think>") has been generated (vLLM's rule); None: from the first token
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k < 0:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def bad(message: str, param: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param, code="invalid_value")

        if not 1 <= self.n <= MAX_N:
            raise bad(f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty must be in [-2, 2]", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty must be in [-2, 2]", "frequency_penalty")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty must be in (0, 2]", "repetition_penalty")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens must be between 0 and max_tokens", "min_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad(f"logprobs must be between 0 and {MAX_LOGPROBS}", "logprobs")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                if not -100.0 <= float(bias) <= 100.0:
                    raise bad(f"logit_bias for token {token} must be in [-100, 100]", "logit_bias")
        if self.seed is not None and not 0 <= self.seed < 2**63 - MAX_N:
            raise bad("seed must be in [0, 2**63 - 129)", "seed")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative", "stop_token_ids")
