"""Qwen3 (hybrid thinking): the model opens `<think>` itself unless the template did; with
`chat_template_kwargs.enable_thinking` false the template closes an empty block and the output
is all content. Output that never opens a block is content."""

from __future__ import annotations

from backend_engine.reasoning.base import PromptEnd, ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def starts_in_reasoning(self, prompt: str) -> bool:
        return self.prompt_end(prompt) is PromptEnd.OPEN
