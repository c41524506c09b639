"""Builds the configured proposer."""

from __future__ import annotations

from backend_engine.config import EngineConfig
from backend_engine.spec_decode.ngram import NgramProposer


def build_proposer(config: EngineConfig, tokenizer):
    if config.speculative_method is None:
        return None
    if config.speculative_method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
    raise ValueError(f"speculative method {config.speculative_method!r} is not available")
