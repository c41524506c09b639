"""DeepSeek-R1 and its distills (Qwen2, Llama), QwQ, Qwen3-Thinking: the model always thinks
first; its template opens the block (`<think>\n`) or the model does. Output without `</think>`
is all reasoning (vLLM's rule for this parser)."""

from __future__ import annotations

from backend_engine.reasoning.base import PromptEnd, ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def starts_in_reasoning(self, prompt: str) -> bool:
        return self.prompt_end(prompt) is not PromptEnd.CLOSED
