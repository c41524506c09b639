"""One sequence's grammar matcher. Its state always matches the sequence's output tokens:
drafts are only tried (and rolled back), so preemption and recompute need nothing from it."""

from __future__ import annotations

import torch
import xgrammar as xgr


class SequenceGrammar:
    __slots__ = ("matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar):
        self.matcher = xgr.GrammarMatcher(compiled)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing may follow."""
        return self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar accepts (none after one that terminates it)."""
        n = 0
        for token in drafts:
            if not self.matcher.accept_token(token):
                break
            n += 1
            if self.matcher.is_terminated():
                break
        if n:
            self.matcher.rollback(n)
        return n

    def fill(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows row..row+len(drafts): the allowed next tokens now and after each draft."""
        m = self.matcher
        m.fill_next_token_bitmask(bitmask, row)
        accepted = 0
        for j, token in enumerate(drafts):
            if not m.accept_token(token):
                break  # never for validated drafts; the rows left stay unconstrained
            accepted += 1
            if m.is_terminated():
                break  # a stop token ends the output: what follows it is discarded
            m.fill_next_token_bitmask(bitmask, row + j + 1)
        if accepted:
            m.rollback(accepted)
