"""Token ids of a rendered chat, reusing the ids of the text between special tokens that earlier
requests already had: a long system prompt or document, or a conversation's earlier turns, is
tokenised once, not on every request (whole-text tokenisation grows with the prompt and is most
of the routing tier's CPU on long prompts; benchmarks/prompt_tokens.py measures both ways).

It is exact because of how `tokenizers` encodes: it first cuts the text at every added token
(`<|im_start|>`, `<|im_end|>`, ...), and then normalises, pre-tokenises and runs the model on
each piece on its own. So the ids of a text are its pieces' ids in order, and a piece's ids can
be kept. That holds only where nothing looks across pieces or depends on a piece's place, so
only tokenizers of that kind use the cache (`eligible`): no normaliser, a byte-level
pre-tokenizer (alone or after regex splits), a BPE model, and added tokens matched as written
(not normalised, no stripping of the space around them, not single-word only). A Metaspace
tokenizer (Llama 2, Gemma), whose first piece gets a leading "▁", is tokenised whole. As a
guard, the first requests and then one in `VERIFY_EVERY` are also tokenised whole and compared;
a difference turns the cache off for that tokenizer, with a warning."""

from __future__ import annotations

import json
import logging
import re
from array import array
from collections import OrderedDict

from tokenizers import Tokenizer

log = logging.getLogger(__name__)

MAX_PIECES = 4096  # pieces kept, least recently used dropped first
MAX_CHARS = 16 << 20  # and at most this much text in them
MAX_SEEN = 1 << 16  # hashes of pieces seen once: a piece is kept the second time it is seen
VERIFY_FIRST = 16  # encodes compared with the whole-text encoding from the start
VERIFY_EVERY = 512  # then one in this many
_SPLIT_PRE_TOKENIZERS = {"Split", "Digits", "Punctuation", "WhitespaceSplit"}


def eligible(tokenizer: Tokenizer) -> str | None:
    """None when the tokenizer encodes each piece between added tokens on its own; else why not."""
    if tokenizer.encode_special_tokens:
        return "special tokens are split as text"
    if tokenizer.normalizer is not None:
        return "it has a normaliser"
    spec = json.loads(tokenizer.to_str())
    if (spec.get("model") or {}).get("type") != "BPE":
        return "its model is not BPE"
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if len(byte_level) != 1 or byte_level[0].get("add_prefix_space") \
            or any(s.get("type") not in _SPLIT_PRE_TOKENIZERS | {"ByteLevel"} for s in steps):
        return "its pre-tokenizer is not byte-level"
    for added in spec.get("added_tokens", []):
        if added.get("normalized") or added.get("lstrip") or added.get("rstrip") \
                or added.get("single_word"):
            return f"added token {added.get('content')!r} is not matched as written"
    return None


class SegmentCache:
    """`encode(text)` = `tokenizer.encode(text, add_special_tokens=False).ids`, by pieces."""

    def __init__(self, tokenizer: Tokenizer, source: str = "") -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.disabled = eligible(tokenizer)
        added = {token.content: token_id for token_id, token
                 in tokenizer.get_added_tokens_decoder().items()}
        self._added = added
        # Longest first: at any position the longest added token matches, as `tokenizers` does.
        self._split = re.compile("(" + "|".join(
            re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")") if added else None
        # ids as 32-bit arrays: compact, and nothing for the garbage collector to scan
        self._pieces: OrderedDict[str, array] = OrderedDict()
        self._seen: set[int] = set()
        self._chars = 0
        self.encodes = self.hits = self.misses = 0

    def encode(self, text: str) -> list[int]:
        if self.disabled is not None or self._split is None:
            return self._whole(text)
        self.encodes += 1
        ids = self._by_pieces(text)
        if self.encodes <= VERIFY_FIRST or self.encodes % VERIFY_EVERY == 0:
            whole = self._whole(text)
            if whole != ids:
                self.disabled = "its pieces' ids differed from the whole text's"
                self._pieces.clear()
                log.warning("tokenizer %s: ids by pieces differed from the whole text's; "
                            "tokenising whole from now on", self.source)
                return whole
        return ids

    def _whole(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _by_pieces(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # an added token (the split's captured separator)
                ids.append(self._added[piece])
            elif piece:
                ids += self._piece(piece)
        return ids

    def _piece(self, piece: str) -> list[int] | array:
        cached = self._pieces.get(piece)
        if cached is not None:
            self.hits += 1
            self._pieces.move_to_end(piece)
            return cached
        self.misses += 1
        ids = self._whole(piece)
        # Kept from its second sighting: a text every request has once (a new document, a new
        # question) costs a hash, not a place that would push out a piece that repeats.
        key = hash(piece)
        if key not in self._seen:
            if len(self._seen) >= MAX_SEEN:
                self._seen.clear()
            self._seen.add(key)
        elif len(piece) <= MAX_CHARS:
            self._seen.discard(key)
            self._pieces[piece] = array("I", ids)
            self._chars += len(piece)
            while len(self._pieces) > MAX_PIECES or self._chars > MAX_CHARS:
                dropped, _ = self._pieces.popitem(last=False)
                self._chars -= len(dropped)
        return ids
