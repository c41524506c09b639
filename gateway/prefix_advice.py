"""Prefix-stability advice: prompts that defeat the prefix cache with a volatile field early on.

Per (key, model) the advisor keeps the token ids of a few recent prompts. A new prompt whose
shared prefix with one of them breaks on a short volatile field (a timestamp, a number, an id,
a uuid, a name) and that agrees with it again afterwards, for at least `min_saving_blocks` more
KV blocks, is an occurrence at that field's position. A position with `min_occurrences` within
the last `window` prompts of its (key, model) is advice: its position, a masked excerpt (never
the values), and the prefill tokens per request that moving the field to the end would save.
Pure and bounded: no I/O; the entries, the prompts kept and the tokens compared are capped."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.field_locator import Field, TokenText, locate_field
from gateway.prefix_divergence import find_divergence, pack, run_length, shares_prefix
from gateway.volatile_fields import MASK


@dataclass(slots=True)
class AdviceConfig:
    block_size: int = 16
    max_prompt_tokens: int = 4096  # only a prompt's head is kept and compared
    recent_prompts: int = 8  # kept per (key, model)
    max_span_tokens: int = 48  # the divergent text on either side; longer is not a field
    min_saving_blocks: int = 2  # smaller gains are not worth advice
    min_occurrences: int = 3  # a field becomes advice after this many occurrences ...
    window: int = 32  # ... within this many prompts of its (key, model)
    max_entries: int = 64  # (key, model) pairs tracked; the least recently used is dropped
    max_fields: int = 4  # positions tracked per (key, model)
    max_values: int = 64  # field values remembered per position (as hashes)


@dataclass(slots=True)
class FieldAdvice:
    key: str
    model: str
    position: int  # the field's first token
    kind: str
    shape: str
    left: tuple[str, ...]
    right: tuple[str, ...]
    glued: tuple[bool, bool]
    cached_tokens_now: int  # what the cache can reuse today: whole blocks before the field
    saving_tokens: int  # per request, from the latest occurrence
    first_seen: float
    last_seen: float = 0.0
    occurrences: int = 0
    wasted_tokens: int = 0  # the saving, summed over occurrences
    reported: int = 0  # occurrences already counted in the metrics
    reported_waste: int = 0
    recent: deque[int] = field(default_factory=deque)  # prompt ordinals of recent occurrences
    values: OrderedDict[int, None] = field(default_factory=OrderedDict)  # hashes of values seen

    @property
    def excerpt(self) -> str:
        before = " ".join(["…", *self.left]) + ("" if self.glued[0] else " ")
        after = ("" if self.glued[1] else " ") + " ".join([*self.right, "…"])
        return f"{before}⟦{self.shape}⟧{after}"


@dataclass(slots=True)
class Occurrence:
    advice: FieldAdvice
    active: bool
    reported: int  # occurrences to add to the metrics now (all so far when advice starts)
    reported_waste: int


@dataclass(slots=True, frozen=True)
class AdvisorSize:
    entries: int  # (key, model) pairs tracked
    prompts: int  # prompts kept for comparison
    prompt_bytes: int  # their packed token ids


@dataclass(slots=True)
class _Entry:
    prompts: deque[tuple[str | None, bytes]]
    seen: int = 0  # prompts observed
    fields: dict[int, FieldAdvice] = field(default_factory=dict)


def _merge(kept: tuple[str, ...], new: tuple[str, ...], from_right: bool) -> tuple[str, ...]:
    """Words that differ between occurrences are prompt data, not template: mask them."""
    if from_right:
        return tuple(reversed(_merge(tuple(reversed(kept)), tuple(reversed(new)), False)))
    return tuple(k if k == n else MASK for k, n in zip(kept, new))


class PrefixAdvisor:
    def __init__(self, config: AdviceConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config or AdviceConfig()
        self.clock = clock
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()

    def observe(self, key: str, model: str, tokens: Sequence[int], tokenizer: TokenText,
                salt: str | None = None) -> Occurrence | None:
        """Record one prompt; the occurrence it makes, if any. Prompts with different cache
        salts never share blocks, so only prompts of the same salt are compared."""
        packed = pack(tokens, self.config.max_prompt_tokens)
        if packed is None:
            return None
        entry = self._entry(key, model)
        entry.seen += 1
        found = self._find_field(entry, packed, salt, tokenizer)
        if not entry.prompts or entry.prompts[-1] != (salt, packed):
            entry.prompts.append((salt, packed))
        return None if found is None else self._count(entry, key, model, found)

    def _entry(self, key: str, model: str) -> _Entry:
        entry = self._entries.get((key, model))
        if entry is None:
            entry = self._entries[(key, model)] = _Entry(deque(maxlen=self.config.recent_prompts))
            if len(self._entries) > self.config.max_entries:
                self._entries.popitem(last=False)
        self._entries.move_to_end((key, model))
        return entry

    def _find_field(self, entry: _Entry, packed: bytes, salt: str | None,
                    tokenizer: TokenText) -> Field | None:
        """The field where the prompt leaves the most recent of the prompts it shares the
        longest prefix with — the prefix the cache can serve; a break from any other recent
        prompt is no cache miss."""
        c = self.config
        best, longest = None, 0
        for old_salt, old in reversed(entry.prompts):
            # One slice comparison tells whether an older prompt can share more than the best.
            if old_salt == salt and (best is None or shares_prefix(packed, old, longest + 1)):
                best, longest = old, longest + run_length(packed, longest, old, longest)
        if best is None:
            return None
        div = find_divergence(packed, best, longest, c.max_span_tokens, c.block_size,
                              c.min_saving_blocks)
        found = None if div is None else locate_field(packed, best, div, tokenizer)
        if found is None or found.saving_tokens(c.block_size) < c.min_saving_blocks * c.block_size:
            return None
        return found

    def _count(self, entry: _Entry, key: str, model: str, found: Field) -> Occurrence | None:
        c, now = self.config, self.clock()
        advice = entry.fields.get(found.start)
        if advice is not None and found.values[0] in advice.values:
            # A value seen before (a returning user, one of a few variants): the engine likely
            # still holds that prompt's blocks, so this is no miss the field causes every time.
            advice.values.move_to_end(found.values[0])
            return None
        if advice is None:
            if len(entry.fields) >= c.max_fields:
                stalest = min(entry.fields.values(), key=lambda a: a.recent[-1])
                del entry.fields[stalest.position]
            advice = entry.fields[found.start] = FieldAdvice(
                key, model, found.start, found.kind, found.shape, found.left, found.right,
                found.glued, found.cached_tokens_now(c.block_size), 0, now,
                recent=deque(maxlen=c.window))
        else:
            advice.left = _merge(advice.left, found.left, from_right=True)
            advice.right = _merge(advice.right, found.right, from_right=False)
            advice.kind, advice.shape = found.kind, found.shape
        for value in found.values:
            advice.values[value] = None
            advice.values.move_to_end(value)
        while len(advice.values) > c.max_values:
            advice.values.popitem(last=False)
        advice.saving_tokens = found.saving_tokens(c.block_size)
        advice.occurrences += 1
        advice.wasted_tokens += advice.saving_tokens
        advice.last_seen = now
        advice.recent.append(entry.seen)
        active = self._active(entry, advice)
        reported = reported_waste = 0
        if active:
            reported, advice.reported = advice.occurrences - advice.reported, advice.occurrences
            reported_waste = advice.wasted_tokens - advice.reported_waste
            advice.reported_waste = advice.wasted_tokens
        return Occurrence(advice, active, reported, reported_waste)

    def _recent(self, entry: _Entry, advice: FieldAdvice) -> int:
        """Occurrences within the last `window` prompts of the (key, model)."""
        return sum(1 for n in advice.recent if entry.seen - n < self.config.window)

    def _active(self, entry: _Entry, advice: FieldAdvice) -> bool:
        return self._recent(entry, advice) >= self.config.min_occurrences

    def snapshot(self) -> list[dict]:
        """Every field that is or was advice, active first, then by prefill tokens wasted.
        Candidates that never recurred enough are not shown: one-offs are no advice."""
        rows = []
        for entry in self._entries.values():
            for advice in entry.fields.values():
                if not advice.reported:
                    continue
                recent = self._recent(entry, advice)
                rows.append({
                    "key": advice.key, "model": advice.model,
                    "active": recent >= self.config.min_occurrences,
                    "position_tokens": advice.position,
                    "position_block": advice.position // self.config.block_size,
                    "kind": advice.kind, "excerpt": advice.excerpt,
                    "occurrences": advice.occurrences, "recent_occurrences": recent,
                    "window_prompts": self.config.window,
                    "cached_tokens_now": advice.cached_tokens_now,
                    "saving_tokens_per_request": advice.saving_tokens,
                    "wasted_prefill_tokens": advice.wasted_tokens,
                    "first_seen": advice.first_seen, "last_seen": advice.last_seen})
        rows.sort(key=lambda r: (not r["active"], -r["wasted_prefill_tokens"]))
        return rows

    def active_savings(self) -> dict[tuple[str, str], int]:
        """Per (key, model) with active advice, the largest saving per request."""
        out: dict[tuple[str, str], int] = {}
        for (key, model), entry in self._entries.items():
            for advice in entry.fields.values():
                if self._active(entry, advice):
                    out[(key, model)] = max(out.get((key, model), 0), advice.saving_tokens)
        return out

    def size(self) -> AdvisorSize:
        prompts = [p for e in self._entries.values() for _, p in e.prompts]
        return AdvisorSize(len(self._entries), len(prompts), sum(len(p) for p in prompts))
