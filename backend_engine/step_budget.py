"""How much prefill a step may carry, and how many sequences may run, for an inter-token latency
target; and how long the waiting queue will take to drain (for admission control).

Running decodes set a floor on the step's time (their rows and the context they read); the rest
of the target goes to prefill chunks, sized by the cost model (a chunk's cost grows with its
context). A new sequence is admitted only while the decode step it joins stays inside the target,
so a burst raises the queue, not everyone's ITL; at least `min_prefill_tokens` of prefill per step
keeps new requests moving when decodes alone fill the target (Sarathi-Serve's stall-free
batching, with the budget derived from a latency target instead of fixed); more where a step
with prefill pays a large fixed cost, so that cost is amortised (`StepBudget.floor_tokens`); and
a step's prefill is rounded up to the rows the forward pass computes at once (`granule`: a
32-token chunk in 64-row GEMM tiles costs what 64 tokens do). The scheduler asks this module; it
never touches tensors."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from backend_engine.step_cost import StepCostModel, StepShape

# CPU: 250 ms, the mean ITL of trace_load's goodput SLO. Under its burst a tighter target held
# ITL p99 lower but left prefill chunks so small that output tok/s and TTFT p99 only matched
# llama.cpp's (docs/benchmarks/trace-load.md).
DEFAULT_TARGET_ITL_MS = {"cpu": 250.0, "cuda": 40.0}


def default_target_itl_ms(device: str) -> float:
    return DEFAULT_TARGET_ITL_MS["cuda" if device.startswith("cuda") else "cpu"]


@dataclass(slots=True)
class DecodeLoad:
    rows: int = 0  # sequences decoding this step (drafts add rows)
    context_tokens: int = 0  # context those rows attend to


class StepBudget:
    def __init__(self, model: StepCostModel, target_itl_s: float, min_prefill_tokens: int,
                 max_prefill_tokens: int, granule: int = 1):
        """granule: prompt rows the forward pass computes at once (the CPU `tiles` form pads a
        step's prompt rows to a multiple of its 64-row tile: accel/cpu/tiles.py); a step's
        prefill is rounded up to a multiple of it, since the padding rows cost the same."""
        self.model = model
        self.target_itl_s = target_itl_s
        self.min_prefill_tokens = min_prefill_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.granule = max(1, granule)

    def prefill_seconds(self, load: DecodeLoad) -> float:
        """Time left in the step for prefill chunks once the running decodes and the step's
        fixed prefill cost (`StepCostModel.prefill_pass_s`) are paid for."""
        decode = self.model.predict(StepShape(decode_rows=load.rows,
                                              context_tokens=load.context_tokens))
        return max(0.0, self.target_itl_s - decode - self.model.prefill_pass_s)

    @property
    def floor_tokens(self) -> int:
        """Prefill a step always carries (when some waits), even past the target: at least
        `min_prefill_tokens`, and at least the chunk whose own token cost equals the step's fixed
        prefill cost, so a step never pays that cost (int4 on CPU: dequantising every weight)
        for a sliver of tokens — at least half of a floor step's prefill time moves prompts."""
        per_token = self.model.per_prefill_token_s
        amortised = math.ceil(self.model.prefill_pass_s / per_token) if per_token > 0 else 0
        return self.whole_granules(max(self.min_prefill_tokens, amortised))

    def whole_granules(self, tokens: int) -> int:
        """A step's prefill tokens rounded up to whole granules (at most max_prefill_tokens)."""
        g = self.granule
        return min(self.max_prefill_tokens, -(-tokens // g) * g)

    def chunk_tokens(self, seconds: float, cached_context: int) -> int:
        """The longest chunk (after cached_context tokens) that fits in `seconds`:
        per_token * n + per_pair * n * (cached_context + n) <= seconds."""
        a, p = self.model.per_prefill_token_s, self.model.per_attention_pair_s
        b = a + p * cached_context
        if p > 0:
            n = (-b + math.sqrt(b * b + 4 * p * seconds)) / (2 * p)
        elif b > 0:
            n = seconds / b
        else:
            return self.max_prefill_tokens
        return int(min(self.max_prefill_tokens, n))

    def chunk_seconds(self, tokens: int, cached_context: int) -> float:
        """The modelled cost of a prefill chunk of `tokens` after cached_context tokens."""
        return (self.model.per_prefill_token_s * tokens
                + self.model.per_attention_pair_s * tokens * (cached_context + tokens))

    def admits(self, load: DecodeLoad, new_context: int) -> bool:
        """Whether one more running sequence keeps the decode-only step inside the target."""
        if load.rows == 0:
            return True
        joined = StepShape(decode_rows=load.rows + 1,
                           context_tokens=load.context_tokens + new_context)
        return self.model.predict(joined) <= self.target_itl_s

    def prefill_rate(self, load: DecodeLoad, cached_context: int = 0) -> float:
        """Prefill tokens per second this replica sustains under `load` (model estimate)."""
        seconds = self.prefill_seconds(load)
        tokens = max(self.floor_tokens, self.chunk_tokens(seconds, cached_context))
        step = self.model.predict(StepShape(
            prefill_tokens=tokens, decode_rows=load.rows, context_tokens=load.context_tokens,
            attention_pairs=tokens * (cached_context + tokens)))
        return tokens / step if step > 0 else float("inf")


def prompt_work(scheduled: list) -> int:
    """Queued prompt tokens a scheduled step computes (a lone last prompt token included; what
    it found cached the caller adds): the work QueueDrain measures."""
    return sum(n for seq, n in scheduled
               if seq.num_computed_tokens < max(seq.num_prompt_tokens, seq.num_tokens - 1))


class QueueDrain:
    """Prompt tokens per second the engine actually retires while requests wait, computed or
    found cached (an exponentially weighted rate over busy steps).

    A queue's rate is measured only while it lasts: a step after which nothing waits forgets
    it, and the next queue starts from the step budget's estimate (`prior`). Kept across an
    empty queue, a rate measured while the running batch was full (the waiting request
    admitted by no step: ~0 tokens/s) made the replica refuse every request but when idle,
    and, with nothing waiting, no step ever measured it again."""

    def __init__(self, half_life_s: float = 5.0):
        self.half_life_s = half_life_s
        self.rate: float | None = None  # tokens/s, None while no queue is being measured

    def observe(self, prefill_tokens: int, seconds: float, queue_waiting: bool,
                prior: Callable[[], float | None] = lambda: None) -> None:
        """One busy step; `prior()`: the rate a new queue starts from (None or inf: the first
        step's own)."""
        if seconds <= 0:
            return
        if not queue_waiting:
            self.rate = None
            return
        sample = prefill_tokens / seconds
        start = self.rate if self.rate is not None else prior()
        if start is None or not math.isfinite(start):
            self.rate = sample
            return
        keep = 0.5 ** (seconds / self.half_life_s)
        self.rate = keep * start + (1 - keep) * sample
