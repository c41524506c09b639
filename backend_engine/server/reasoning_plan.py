"""How a chat request's reasoning shapes its generation and its answer: where the rendered
prompt leaves the model (inside a think block or not), whether a grammar must wait for the end
of the reasoning, and the reasoning and content of each choice (`--reasoning-parser`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from backend_engine.reasoning import ReasoningParser, ReasoningStream
from backend_engine.sampling_params import SamplingParams

PROMPT_TAIL_TOKENS = 32  # enough of the prompt to see a think block the template opened


@dataclass(slots=True)
class ReasoningPlan:
    parser: ReasoningParser | None  # None: the reply is all content
    prompt: str = ""  # the rendered prompt's tail
    include: bool = True  # False (vLLM's include_reasoning): split off, but not returned

    @classmethod
    def build(cls, parser: ReasoningParser | None, tokenizer, prompt: list[int],  # noqa: ANN001
              include: bool | None = True) -> "ReasoningPlan":
        if parser is None:
            return cls(None)
        return cls(parser, tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:],
                                            skip_special_tokens=False), include is not False)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """The params with structured outputs (a response format, forced tool calls) held back
        until the reasoning ends, when reasoning may come first."""
        if self.parser is None or params.structured_outputs is None \
                or not self.parser.reasoning_may_follow(self.prompt):
            return params
        return dataclasses.replace(params, reasoning_end=self.parser.end)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished choice; content None: no answer after the
        reasoning (cut off while thinking)."""
        if self.parser is None:
            return None, text
        split = self.parser.split(text, self.parser.starts_in_reasoning(self.prompt), final=True)
        return split.reasoning if self.include else None, split.content

    def stream(self) -> ReasoningStream | None:
        return ReasoningStream(self.parser, self.prompt) if self.parser is not None else None
