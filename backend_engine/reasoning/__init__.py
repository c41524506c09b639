"""Reasoning parsers, one per model family's way of thinking aloud (vLLM's names,
`--reasoning-parser`): they split `<think>…</think>` from the answer. Other API edges (the
Anthropic Messages API's `thinking` blocks) call `extract_reasoning` or `ReasoningStream`."""

from __future__ import annotations

import logging

from backend_engine.reasoning.base import PromptEnd, ReasoningParser, ReasoningSplit
from backend_engine.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from backend_engine.reasoning.qwen3 import Qwen3ReasoningParser
from backend_engine.reasoning.stream import ReasoningStream

PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}
CHOICES = ("auto", "none", *PARSERS)
log = logging.getLogger("kvgate.engine")


def check_name(name: str) -> None:
    if name not in CHOICES:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(CHOICES)}")


def parser_for(name: str, chat_template: str | None = None,
               generation_prompt: str = "") -> ReasoningParser | None:
    """The named parser, None for "none"; "auto" picks by the chat template (`generation_prompt`:
    what it renders for a one-message conversation) where that is unambiguous."""
    check_name(name)
    if name == "auto":
        name = detect(chat_template, generation_prompt) or "none"
    return None if name == "none" else PARSERS[name]()


def detect(chat_template: str | None, generation_prompt: str) -> str | None:
    """qwen3 for templates with the enable_thinking switch, deepseek_r1 for templates that open
    a think block for the model; None for templates without think tags, or that name them
    otherwise (logged: pass --reasoning-parser)."""
    template = chat_template or ""
    start, end = ReasoningParser.start, ReasoningParser.end
    if start not in template and end not in template:
        return None
    if "enable_thinking" in template:
        return "qwen3"
    if DeepSeekR1ReasoningParser().prompt_end(generation_prompt) is PromptEnd.OPEN:
        return "deepseek_r1"
    log.warning("the chat template names %s but neither opens it for the model nor has "
                "enable_thinking: reasoning stays in the content; pass --reasoning-parser to "
                "split it", start)
    return None


def extract_reasoning(parser: ReasoningParser, model_output: str,
                      prompt: str = "") -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished output; `prompt`: the rendered prompt (or its tail),
    which says whether the output began inside a think block."""
    split = parser.split(model_output, parser.starts_in_reasoning(prompt), final=True)
    return split.reasoning, split.content


__all__ = ["CHOICES", "PARSERS", "PromptEnd", "ReasoningParser", "ReasoningSplit",
           "ReasoningStream", "check_name", "detect", "extract_reasoning", "parser_for"]
