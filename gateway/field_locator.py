"""From a token-level divergence to the field that causes it: widen the divergent span to the
whole field (a date whose first digits happened to agree, the rest of a name), read both
prompts' versions, and say whether it is a short volatile field. Text comes from the model's
tokenizer, only for the few tokens around the divergence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.prefix_divergence import Divergence, unpack
from gateway.volatile_fields import context_words_masked, is_field_char, mask_field, pair_kind


class TokenText(Protocol):
    """What the locator needs of a tokenizer (gateway.tokenizer.LocalTokenizer has both)."""

    def decode(self, token_ids: list[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...


MAX_WIDEN_TOKENS = 24  # how far a field may extend beyond the divergent span, each side
CONTEXT_TOKENS = 16  # decoded around the field for its masked excerpt
CONTEXT_WORDS = 5


@dataclass(slots=True, frozen=True)
class Field:
    start: int  # token index where the field starts (in both prompts)
    new_end: int  # where it ends in the new prompt
    old_end: int
    kind: str
    shape: str  # the new prompt's field, masked
    left: tuple[str, ...]  # masked template words before it
    right: tuple[str, ...]  # and after it
    glued: tuple[bool, bool]  # no space between the field and the word before / after it
    values: tuple[int, int]  # hashes of the new and the old prompt's field text (never the text)
    shared_after_fix: int  # tokens both prompts would share with the field moved to the end

    def cached_tokens_now(self, block_size: int) -> int:
        """What the prefix cache reuses today: the whole blocks before the field."""
        return self.start // block_size * block_size

    def saving_tokens(self, block_size: int) -> int:
        """Prefill tokens per request the cache would add with the field moved to the end."""
        return self.shared_after_fix // block_size * block_size - self.cached_tokens_now(block_size)


def _glued(text: str) -> bool:
    """A token that continues a field: field characters only (a leading space starts a word)."""
    core = text.lstrip()
    return bool(core) and len(core) >= len(text) - 1 and all(is_field_char(c) for c in core)


class _Tokens:
    """The text of one packed prompt's tokens, decoded on demand."""

    def __init__(self, packed: bytes, tokenizer: TokenText) -> None:
        self.packed, self.tokenizer = packed, tokenizer
        self.ids = memoryview(packed).cast("I")

    def text(self, i: int) -> str:
        return self.tokenizer.token_text(self.ids[i]) if 0 <= i < len(self.ids) else ""

    def span(self, start: int, end: int) -> str:
        return self.tokenizer.decode(unpack(self.packed, max(0, start), min(len(self.ids), end)))


def _bridges(tokens: _Tokens, i: int) -> bool:
    """Token i is the single space inside a date-time ("2024-05-01 10:32")."""
    return (tokens.text(i) == " " and tokens.text(i - 1)[-1:].isdigit()
            and tokens.text(i + 1)[:1].isdigit())


def _widen_left(tokens: _Tokens, start: int) -> int:
    limit = max(0, start - MAX_WIDEN_TOKENS)
    while start > limit and not tokens.text(start)[:1].isspace():
        if _glued(tokens.text(start - 1)):
            start -= 1
        elif start - 2 >= limit and _bridges(tokens, start - 1):
            start -= 2
        else:
            break
    return start


def _widen_right(tokens: _Tokens, end: int, limit: int) -> int:
    """Tokens from `end` (at most `limit`) that still belong to the field."""
    grown = 0
    while grown < limit:
        text = tokens.text(end + grown)
        if text and not text[:1].isspace() and _glued(text):
            grown += 1
        elif grown + 2 <= limit and _bridges(tokens, end + grown):
            grown += 2
        else:
            break
    return grown


def locate_field(new: bytes, old: bytes, div: Divergence, tokenizer: TokenText) -> Field | None:
    """The volatile field behind `div`, or None when the divergent text is not one."""
    new_tokens, old_tokens = _Tokens(new, tokenizer), _Tokens(old, tokenizer)
    start = _widen_left(new_tokens, div.start)
    grown = _widen_right(new_tokens, div.new_end, min(MAX_WIDEN_TOKENS, div.tail))
    new_text = new_tokens.span(start, div.new_end + grown)
    old_text = old_tokens.span(start, div.old_end + grown)
    kind = pair_kind(new_text, old_text)
    if kind is None:
        return None
    before = new_tokens.span(start - CONTEXT_TOKENS, start)
    after = new_tokens.span(div.new_end + grown, div.new_end + grown + CONTEXT_TOKENS)
    glued = (bool(before) and not before[-1:].isspace() and not new_text[:1].isspace(),
             bool(after) and not after[:1].isspace())
    return Field(start, div.new_end + grown, div.old_end + grown, kind, mask_field(new_text),
                 tuple(context_words_masked(before)[-CONTEXT_WORDS:]),
                 tuple(context_words_masked(after)[:CONTEXT_WORDS]), glued,
                 (hash(new_text.strip()), hash(old_text.strip())), start + div.tail - grown)
