"""What every reasoning parser shares: the split of a model's text into its reasoning (between
`<think>` and `</think>`) and its answer, final or safe-so-far while streaming, given how the
prompt left the model: inside an open think block, after a closed one, or neither."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from backend_engine.tool_parsers.base import safe_length


class PromptEnd(Enum):
    """Where the rendered prompt leaves the model with respect to thinking."""

    OPEN = "open"  # inside a think block the template opened (DeepSeek-R1, Qwen3-Thinking)
    CLOSED = "closed"  # right after a closed one (Qwen3 with enable_thinking false)
    NONE = "none"


@dataclass(slots=True)
class ReasoningSplit:
    reasoning: str | None
    content: str | None


class ReasoningParser:
    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    def prompt_end(self, prompt: str) -> PromptEnd:
        """How `prompt` (its rendered text, or its tail) leaves the model."""
        if prompt.rfind(self.start) > prompt.rfind(self.end):
            return PromptEnd.OPEN
        if prompt.rstrip().endswith(self.end):
            return PromptEnd.CLOSED
        return PromptEnd.NONE

    def starts_in_reasoning(self, prompt: str) -> bool:
        """Whether the model's output begins as reasoning (before any tag of its own)."""
        raise NotImplementedError

    def reasoning_may_follow(self, prompt: str) -> bool:
        """Whether the output may hold reasoning, so a grammar waits for its end (vLLM's rule:
        structured outputs and tool calls apply after the reasoning)."""
        return self.prompt_end(prompt) is not PromptEnd.CLOSED

    def split(self, text: str, in_reasoning: bool, final: bool) -> ReasoningSplit:
        """Reasoning and content of `text`. Not final: only what can no longer change (a tail
        that may grow into a tag waits; content is "" until it has more than blanks)."""
        lead = text.lstrip()
        if lead.startswith(self.start):  # the model opened the block itself
            in_reasoning, text = True, lead[len(self.start):]
        elif not final and self.start.startswith(lead):  # blanks, or a tag still growing
            return ReasoningSplit("" if in_reasoning else None, "")
        if not in_reasoning:
            return ReasoningSplit(None, text)
        at = text.find(self.end)
        if at < 0:  # still thinking (or cut off while thinking: all of it is reasoning)
            return ReasoningSplit(text if final else text[:safe_length(text, (self.end,))],
                                  None if final else "")
        content = text[at + len(self.end):].lstrip()
        return ReasoningSplit(text[:at] or (None if final else ""),
                              content or (None if final else ""))
