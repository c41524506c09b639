"""Streaming a reply that may open with reasoning: reasoning and content deltas as soon as each
can no longer change, and at the end exactly what the non-streamed reply holds."""

from __future__ import annotations

from backend_engine.reasoning.base import ReasoningParser


class ReasoningStream:
    def __init__(self, parser: ReasoningParser, prompt: str):
        self.parser = parser
        self.in_reasoning = parser.starts_in_reasoning(prompt)
        self.text = ""
        self.sent = ["", ""]  # reasoning, content

    def feed(self, delta_text: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new content) after `delta_text`."""
        self.text += delta_text
        split = self.parser.split(self.text, self.in_reasoning, final)
        out = []
        for i, whole in enumerate((split.reasoning or "", split.content or "")):
            sent = self.sent[i]
            new = whole[len(sent):] if whole.startswith(sent) else ""  # never resend
            self.sent[i] = sent + new
            out.append(new)
        return out[0], out[1]
