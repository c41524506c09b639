"""The proposer interface and the factory for the configured one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from backend_engine.config import EngineConfig
from backend_engine.sampler import SamplingRow
from backend_engine.sequence import Sequence
from backend_engine.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    def propose_batch(self, work: list[tuple[Sequence, int]],
                      rows_for: Callable[[Sequence, list[int]], SamplingRow]) -> None:
        """Set spec_token_ids (and spec_draft_probs for a probabilistic draft) on each
        sequence of (sequence, most tokens it may draft)."""

    def release(self, seq_id: str) -> None:
        """Forget a finished sequence."""


def build_proposer(config: EngineConfig, vocab_size: int, max_model_len: int) -> Proposer | None:
    if config.speculative_method is None:
        return None
    if config.speculative_method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
    from backend_engine.spec_decode.draft import DraftModelProposer

    return DraftModelProposer(config, vocab_size, max_model_len)
