"""A simulated engine replica for the routing simulator: an LRU block cache and a service-time
model, emitting KV events in the engine contract's shape (seq, stored, removed, load).

Service model (one chunked-prefill lane plus a decode batch, as a continuous-batching engine):
  prefill time = (PREFILL_OVERHEAD_S + uncached_tokens * PREFILL_S_PER_TOKEN) * (1 + DECODE_DRAG * decoding)
  decode time  = output_tokens * (DECODE_STEP_S + DECODE_S_PER_SEQ * decoding)
so uncached tokens cost prefill time and a big batch slows both phases.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

PREFILL_OVERHEAD_S = 0.004
PREFILL_S_PER_TOKEN = 0.0002  # 5k prompt tokens/s
DECODE_DRAG = 0.02  # each decoding sequence slows a prefill chunk by 2 %
DECODE_STEP_S = 0.010
DECODE_S_PER_SEQ = 0.0005
# Busy time counts prefill seconds plus this much per decoded token (its share of a batched step).
DECODE_WORK_S_PER_TOKEN = 0.002


@dataclass(slots=True)
class SimRequest:
    arrival: float
    hashes: Sequence[int]
    prompt_tokens: int
    output_tokens: int
    session: str | None = None
    request_id: str = ""
    token_ids: Sequence[int] | None = None  # the prompt, for feeds that describe blocks by tokens
    # filled in by the simulation
    replica: str = ""
    gateway: int = 0
    cached_tokens: int = 0
    predicted_tokens: int = 0
    pending_estimate: int = 0  # the uncached tokens the replica counted as pending at enqueue
    first_token_at: float = 0.0
    finished_at: float = 0.0


@dataclass(slots=True)
class SimReplica:
    name: str
    capacity_blocks: int
    block_size: int
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    queue: deque[SimRequest] = field(default_factory=deque)
    prefilling: SimRequest | None = None
    decoding: int = 0
    pinned_blocks: int = 0
    seq: int = 0
    busy_s: float = 0.0
    pending_prefill_tokens: int = 0

    def peek_hit_blocks(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def cached_tokens(self, req: SimRequest, hit_blocks: int) -> int:
        # An engine always computes the last prompt token, as vLLM does.
        return min(hit_blocks, max(0, (req.prompt_tokens - 1) // self.block_size)) * self.block_size

    def enqueue(self, req: SimRequest) -> dict:
        self.queue.append(req)
        req.pending_estimate = req.prompt_tokens - self.cached_tokens(
            req, self.peek_hit_blocks(req.hashes))
        self.pending_prefill_tokens += req.pending_estimate
        return self._event()

    def start_prefill(self) -> tuple[SimRequest, float, dict]:
        """Pop the next request, take its cache hit, store its blocks; return its prefill time."""
        req = self.queue.popleft()
        cache = self.cache
        hit = self.peek_hit_blocks(req.hashes)
        for h in req.hashes[:hit]:
            cache.move_to_end(h)
        stored = [h for h in req.hashes[hit:] if h not in cache]
        for h in stored:
            cache[h] = None
        removed = []
        while len(cache) > self.capacity_blocks:
            removed.append(cache.popitem(last=False)[0])
        req.cached_tokens = self.cached_tokens(req, hit)
        uncached = req.prompt_tokens - req.cached_tokens
        self.pending_prefill_tokens -= req.pending_estimate
        self.prefilling = req
        self.pinned_blocks += len(req.hashes)
        duration = (PREFILL_OVERHEAD_S + uncached * PREFILL_S_PER_TOKEN) * (
            1 + DECODE_DRAG * self.decoding)
        self.busy_s += duration
        return req, duration, self._event(stored, removed)

    def finish_prefill(self, req: SimRequest) -> float:
        """Move the request to the decode batch; return its decode time."""
        self.prefilling = None
        duration = req.output_tokens * (DECODE_STEP_S + DECODE_S_PER_SEQ * self.decoding)
        self.decoding += 1
        self.busy_s += req.output_tokens * DECODE_WORK_S_PER_TOKEN
        return duration

    def finish(self, req: SimRequest) -> dict:
        self.decoding -= 1
        self.pinned_blocks -= len(req.hashes)
        return self._event()

    def load(self) -> dict:
        return {
            "running": self.decoding + (1 if self.prefilling else 0),
            "waiting": len(self.queue),
            "kv_usage": min(1.0, self.pinned_blocks / self.capacity_blocks),
            "pending_prefill_tokens": self.pending_prefill_tokens,
        }

    def _event(self, stored: Sequence[int] = (), removed: Sequence[int] = ()) -> dict:
        self.seq += 1
        return {"seq": self.seq, "stored": list(stored), "removed": list(removed),
                "cleared": False, "load": self.load()}


def pooled_upper_bound(requests: Sequence[SimRequest], capacity_blocks: int,
                       block_size: int) -> float:
    """Hit rate of one LRU cache as large as all replicas together, fed in arrival order."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit_tokens = prompt_tokens = 0
    for req in requests:
        hit = 0
        for h in req.hashes:
            if h not in cache:
                break
            cache.move_to_end(h)
            hit += 1
        for h in req.hashes[hit:]:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
        hit_tokens += min(hit, max(0, (req.prompt_tokens - 1) // block_size)) * block_size
        prompt_tokens += req.prompt_tokens
    return hit_tokens / max(1, prompt_tokens)
