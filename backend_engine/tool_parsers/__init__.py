"""Tool-call parsers, one per model family's output format (vLLM's names, `--tool-call-parser`):
they turn generated text into OpenAI tool calls, and build the grammar that forces calls."""

from __future__ import annotations

from backend_engine.tool_parsers.base import ParsedToolCall, Split, ToolParser
from backend_engine.tool_parsers.hermes import HermesToolParser
from backend_engine.tool_parsers.llama3_json import Llama3JsonToolParser
from backend_engine.tool_parsers.mistral import MistralToolParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}
CHOICES = ("auto", *PARSERS)


def parser_for(name: str, tokenizer=None) -> ToolParser:  # noqa: ANN001
    """The named parser; "auto" picks by the model's tokenizer (its tool-call tokens)."""
    if name == "auto":
        name = detect(tokenizer)
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(CHOICES)}")
    return PARSERS[name]()


def detect(tokenizer) -> str:  # noqa: ANN001
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    if "[TOOL_CALLS]" in vocab:
        return "mistral"
    if "<|python_tag|>" in vocab:
        return "llama3_json"
    return "hermes"  # Qwen, Hermes, SmolLM, and templates without tools (prompted in its format)


__all__ = ["CHOICES", "PARSERS", "ParsedToolCall", "Split", "ToolParser", "detect", "parser_for"]
