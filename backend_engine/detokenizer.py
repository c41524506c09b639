"""Incremental detokenisation with stop strings that may span token boundaries.

Text is decoded through a short window of earlier tokens so multi-byte characters and
leading-space rules come out right; while a stop string could still be forming, the last
few characters are held back from the stream so a stop string never leaks."""

from __future__ import annotations

_PROMPT_CONTEXT = 6  # prompt tokens used as decoding context for the first output tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.skip_special = skip_special_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of text already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; returns the stop string if the text now contains one."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        if not (check_stop and self.stop):
            return None
        return self._find_stop(start)

    def _find_stop(self, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        self.text = self.text[: at + len(s) if self.include_stop_str else at]
        return s

    def take_delta(self, finished: bool) -> str:
        """New text safe to show: all of it when finished, else all but a possible stop prefix."""
        upto = len(self.text) if finished or not self.stop else len(self.text) - self.hold
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta


class TokenTexts:
    """Cached text of single tokens (for logprobs)."""

    def __init__(self, tokenizer, max_size: int = 65536):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.max_size = max_size

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self.cache) < self.max_size:
                self.cache[token_id] = text
        return text
