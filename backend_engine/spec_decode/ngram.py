"""N-gram (prompt lookup) proposer: find the latest earlier occurrence of the sequence's last
n tokens (prompt and output) and propose the tokens that followed it. No model involved.

Search runs in C: tokens are packed as little-endian u32 and matched with bytes.rfind, keeping
only 4-byte-aligned hits."""

from __future__ import annotations

from array import array
from collections.abc import Callable


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= ngram min <= ngram max")
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) tokens that followed the latest match, or []."""
        k = min(self.k, max_tokens)
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        data = array("I", token_ids).tobytes()
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            pattern = data[-4 * n:]
            end = len(data) - 4  # the match must end before the current suffix starts over
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:
                    start = at // 4 + n
                    return list(token_ids[start:start + k])
                end = at + 4 * n - 1
        return []

    def propose_batch(self, work: list[tuple[object, int]], rows_for: Callable) -> None:
        """Set spec_token_ids on each (sequence, room) pair."""
        for seq, room in work:
            seq.spec_token_ids = self.propose(seq.token_ids, room)

    def release(self, seq_id: str) -> None:
        """The n-gram proposer keeps no per-sequence state."""
