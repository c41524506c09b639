"""Where two prompts' token sequences part, and whether they meet again: the first divergent
token, the first point after it where they realign for good (shortest span in the new prompt
first), and how long they then agree.

Token ids are packed as little-endian uint32 (`pack`), so every comparison is a byte-slice
comparison done in C: the work per pair of prompts is O(prompt length) with a small constant."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

TOKEN_BYTES = 4
ANCHOR_TOKENS = 4  # a realignment must start with this many equal tokens on both sides
_GALLOP_START = 32


@dataclass(slots=True, frozen=True)
class Divergence:
    """`new` and `old` agree on tokens [0, start), differ on new[start:new_end] and
    old[start:old_end], then agree again on `tail` tokens from there."""
    start: int
    new_end: int
    old_end: int
    tail: int


def pack(tokens: Sequence[int], limit: int) -> bytes | None:
    """The first `limit` token ids as bytes; None when an id does not fit 32 bits."""
    try:
        return array("I", tokens[:limit]).tobytes()
    except (OverflowError, TypeError):
        return None


def unpack(packed: bytes, start: int, end: int) -> list[int]:
    return array("I", packed[start * TOKEN_BYTES:end * TOKEN_BYTES]).tolist()


def num_tokens(packed: bytes) -> int:
    return len(packed) // TOKEN_BYTES


def _same(a: bytes, pa: int, b: bytes, pb: int, n: int) -> bool:
    return (a[pa * TOKEN_BYTES:(pa + n) * TOKEN_BYTES]
            == b[pb * TOKEN_BYTES:(pb + n) * TOKEN_BYTES])


def shares_prefix(a: bytes, b: bytes, n: int) -> bool:
    """Both have at least n tokens and agree on the first n."""
    return len(a) >= n * TOKEN_BYTES and _same(a, 0, b, 0, n)


def run_length(a: bytes, pa: int, b: bytes, pb: int) -> int:
    """How many tokens a[pa:] and b[pb:] share from their start (galloping, then bisecting)."""
    n = min(num_tokens(a) - pa, num_tokens(b) - pb)
    lo, hi, step = 0, n, _GALLOP_START
    while lo < n:
        probe = min(n, lo + step)
        if not _same(a, pa + lo, b, pb + lo, probe - lo):
            hi = probe - 1
            break
        lo, step = probe, step * 2
    while lo < hi:  # tokens [0, lo) are equal; the first difference is at or before hi
        mid = (lo + hi + 1) // 2
        if _same(a, pa + lo, b, pb + lo, mid - lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


def min_tail(start: int, block_size: int, min_blocks: int) -> int:
    """The agreeing tail after a divergence at `start` that would extend the shared prefix by
    `min_blocks` whole KV blocks were the divergent span moved out of the way."""
    return (start // block_size + min_blocks) * block_size - start


def find_divergence(new: bytes, old: bytes, start: int, max_span: int, block_size: int,
                    min_blocks: int) -> Divergence | None:
    """The divergence at `start` (their shared prefix, `run_length(new, 0, old, 0)`) when the
    two realign within `max_span` tokens on each side and then agree long enough to fill
    `min_blocks` more KV blocks; None otherwise (one a prefix of the other, or different)."""
    n_new, n_old = num_tokens(new), num_tokens(old)
    need = min_tail(start, block_size, min_blocks)
    if start >= min(n_new, n_old) or min(n_new, n_old) - start < need:
        return None
    window = old[start * TOKEN_BYTES:(start + max_span + ANCHOR_TOKENS) * TOKEN_BYTES]
    for j in range(start, min(n_new - ANCHOR_TOKENS, start + max_span) + 1):
        if n_new - j < need:
            break
        for p in _anchor_positions(window, new[j * TOKEN_BYTES:(j + ANCHOR_TOKENS) * TOKEN_BYTES]):
            p += start
            if n_old - p >= need and _same(new, j, old, p, need):
                return Divergence(start, j, p, run_length(new, j, old, p))
    return None


def _anchor_positions(haystack: bytes, needle: bytes) -> Iterator[int]:
    """Token indexes where `needle` (whole tokens) occurs in `haystack`, in order."""
    at = haystack.find(needle)
    while at >= 0:
        if at % TOKEN_BYTES == 0:
            yield at // TOKEN_BYTES
        at = haystack.find(needle, at + 1)
