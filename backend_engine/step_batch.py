"""StepBatch: one step's work as the model runner reads it, in plain lists. Per scheduled
sequence: the tokens to run, the position of the first, the sequence's real length and its
block table. Free of Sequence objects, so rank 0 of a tensor-parallel replica sends it to the
other ranks and every rank builds its tensors with the same runner code."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend_engine.sequence import Sequence


@dataclass(slots=True)
class StepBatch:
    # per sequence, in scheduler order:
    token_ids: list[list[int]] = field(default_factory=list)  # a prefill chunk, or a decode token (+ drafts)
    num_computed_tokens: list[int] = field(default_factory=list)  # position of the first token
    num_tokens: list[int] = field(default_factory=list)  # real tokens; drafts beyond are verified
    block_ids: list[list[int]] = field(default_factory=list)  # the block table
    num_prompt_tokens: list[int] = field(default_factory=list)  # the prompt's length
    group_block_ids: list[list[list[int]]] = field(default_factory=list)  # groups 1.. (if any)

    @classmethod
    def of(cls, scheduled: list[tuple[Sequence, int]]) -> StepBatch:
        """scheduled: (sequence, tokens to run this step) as the scheduler returns them."""
        batch = cls()
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            batch.token_ids.append(_chunk(seq, start, start + n))
            batch.num_computed_tokens.append(start)
            batch.num_tokens.append(seq.num_tokens)
            batch.block_ids.append(seq.block_ids)  # kept in step with block_table: O(1)
            batch.num_prompt_tokens.append(seq.num_prompt_tokens)
            batch.group_block_ids.append(seq.group_block_ids)
        return batch

    def __len__(self) -> int:
        return len(self.token_ids)


def _chunk(seq: Sequence, start: int, end: int) -> list[int]:
    """Tokens start..end of the sequence followed by its drafts, without copying the whole."""
    chunk = seq.token_ids[start:end]
    if end > seq.num_tokens:
        chunk += seq.spec_token_ids[max(0, start - seq.num_tokens):end - seq.num_tokens]
    return chunk
