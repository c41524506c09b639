"""Volatile fields in prompt text — timestamps, numbers, ids, uuids, a name — and the masked
shapes the gateway shows instead of the text itself (digits as `#`, letters as `▇`, names and
anything long as `▇▇▇`), so advice never carries a prompt's values."""

from __future__ import annotations

import re

UUID, TIMESTAMP, ID, NUMBER, WORD = "uuid", "timestamp", "id", "number", "word"
_PRIORITY = (UUID, TIMESTAMP, ID, NUMBER, WORD)  # the kind a field with several pieces gets
MAX_FIELD_CHARS = 64
MAX_FIELD_PIECES = 4
MAX_FIELD_WORDS = 3
MAX_WORD_CHARS = 24
MASK = "▇▇▇"
FIELD_PUNCT = "-:/_+="  # characters that join the pieces of one field (a date, an id)

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_TIMESTAMP = re.compile(r"\d+(?:[-/:.T]\d+)+(?:Z|[+-]\d\d:?\d\d)?")
_NUMBER = re.compile(r"[+-]?\d[\d,._]*%?")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+/=.#-]{3,63}")
_WORD = re.compile(r"[^\W\d_]+(?:['’.-][^\W\d_]+)*")
_DIGIT = re.compile(r"\d")
_EDGE_PUNCT = "\"'“”‘’()[]{}<>,;:!?."


def _piece_kind(piece: str) -> str | None:
    core = piece.strip(_EDGE_PUNCT)
    if not core:
        return ""  # punctuation only: glue between pieces
    if not _DIGIT.search(core):
        return WORD if len(core) <= MAX_WORD_CHARS and _WORD.fullmatch(core) else None
    if _NUMBER.fullmatch(core):
        return NUMBER
    if _TIMESTAMP.fullmatch(core) and any(c in core for c in "-/:T"):
        return TIMESTAMP
    if _UUID.fullmatch(core):
        return UUID
    return ID if _ID.fullmatch(core) else None


def field_kind(text: str) -> str | None:
    """The kind of a short volatile field ('' for an empty one); None when the text is not one
    (too long, too many words, or prose)."""
    pieces = text.split()
    if not pieces:
        return ""
    if len(text.strip()) > MAX_FIELD_CHARS or len(pieces) > MAX_FIELD_PIECES:
        return None
    kinds = [_piece_kind(p) for p in pieces]
    if None in kinds or kinds.count(WORD) > MAX_FIELD_WORDS:
        return None
    return next((k for k in _PRIORITY if k in kinds), None)


def pair_kind(new: str, old: str) -> str | None:
    """The kind of a field that reads `new` in one prompt and `old` in the other; None unless
    both are volatile fields (one may be empty: the field was added or dropped)."""
    a, b = field_kind(new), field_kind(old)
    if a is None or b is None or not (a or b):
        return None
    return next(k for k in _PRIORITY if k in (a, b))


def is_field_char(c: str) -> bool:
    return c.isalnum() or c in FIELD_PUNCT


def _shape(piece: str) -> str:
    if _UUID.fullmatch(piece.strip(_EDGE_PUNCT)):
        return re.sub(r"[0-9a-fA-F]", "#", piece)
    return "".join("#" if c.isdigit() else "▇" if c.isalpha() else c for c in piece)


def mask_field(text: str) -> str:
    """The field's shape: its words (names) hidden entirely, digits and letters of the rest
    replaced one for one, separators kept."""
    return " ".join(MASK if _piece_kind(p) == WORD else _shape(p) for p in text.split())


def mask_context_word(word: str) -> str:
    """A word next to a field, kept as a template word unless it carries digits, an address
    or is long."""
    if "@" in word or "://" in word or len(word) > 2 * MAX_WORD_CHARS:
        return MASK
    return _shape(word) if _DIGIT.search(word) else word


def context_words_masked(text: str) -> list[str]:
    return [mask_context_word(w) for w in text.split()]
