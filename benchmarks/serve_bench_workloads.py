"""Workloads for the live benchmark. Prompts are token-id lists sent to `/v1/completions`, so
prefix sharing is exact (no tokenizer boundary effects) and identical across policies.

A workload is a list of `Job`s. A job is a sequence of stages; the requests of one stage are
sent together (best-of-N siblings), the next stage starts when the previous one finished
(the next turn of a chat). Closed-loop runs ignore `Job.arrival`; open-loop runs start each job
at its arrival time."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

# Token ids drawn from here avoid the special tokens at the bottom of SmolLM2's vocabulary and
# stay inside every model the engine loads (tiny-random included).
TOKEN_LOW, TOKEN_HIGH = 100, 30_000


@dataclass(slots=True)
class RequestSpec:
    prompt: list[int] | str  # token ids (/v1/completions) or text (one chat user message)
    max_tokens: int
    group: str = ""  # tenant, session or burst: for reading results, never for routing


@dataclass(slots=True)
class Job:
    stages: list[list[RequestSpec]]
    arrival: float = 0.0  # seconds from the start (open-loop runs only)
    think_s: float = 0.0  # pause between stages (a user reading the answer)

    @property
    def num_requests(self) -> int:
        return sum(len(s) for s in self.stages)


@dataclass(slots=True)
class WorkloadParams:
    num_requests: int = 200
    rate: float = 4.0  # jobs per second, for arrival times
    seed: int = 0
    prompt_tokens: int = 384  # system prompt / shared prefix length
    suffix_tokens: int = 32  # per-request unique part
    output_tokens: int = 8
    tenants: int = 16
    zipf_s: float = 0.3  # tenant popularity skew (mild, as in routing_sim)
    turns: int = 6
    siblings: int = 4
    trace: str | None = None
    trace_time_scale: float = 0.05  # trace seconds -> benchmark seconds
    max_prompt_tokens: int = 1024  # cap for trace prompts (this machine prefills ~300 tok/s/core)
    extra: dict = field(default_factory=dict)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


def _poisson_times(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        out.append(t)
    return out


def multi_tenant(p: WorkloadParams) -> list[Job]:
    """Tenants with long shared system prompts, each request a short unique question."""
    rng = random.Random(p.seed)
    systems = [_tokens(rng, p.prompt_tokens) for _ in range(p.tenants)]
    weights = [1 / (i + 1) ** p.zipf_s for i in range(p.tenants)]
    jobs = []
    for t in _poisson_times(rng, p.num_requests, p.rate):
        tenant = rng.choices(range(p.tenants), weights)[0]
        q = _tokens(rng, rng.randint(max(1, p.suffix_tokens // 2), p.suffix_tokens * 3 // 2))
        jobs.append(Job([[RequestSpec(systems[tenant] + q, p.output_tokens, f"tenant-{tenant}")]], t))
    return jobs


def multi_turn(p: WorkloadParams) -> list[Job]:
    """Chat sessions: each turn resends the conversation plus an answer and a new message."""
    rng = random.Random(p.seed)
    sessions = max(1, math.ceil(p.num_requests / p.turns))
    jobs = []
    for s, t in enumerate(_poisson_times(rng, sessions, p.rate / p.turns)):
        history = _tokens(rng, p.prompt_tokens)
        stages = []
        for _ in range(p.turns):
            stages.append([RequestSpec(list(history), p.output_tokens, f"chat-{s}")])
            # The real answer text is not fed back (token ids are not streamed), so a random
            # answer of the same length stands in: the replica has not cached it either way.
            history += _tokens(rng, p.output_tokens) + _tokens(rng, p.suffix_tokens)
        jobs.append(Job(stages, t, think_s=0.5))
    return _trim(jobs, p.num_requests)


def best_of_n(p: WorkloadParams) -> list[Job]:
    """Bursts of N identical prompts sent together (best-of-N sampling, agent fan-out)."""
    rng = random.Random(p.seed)
    bursts = max(1, math.ceil(p.num_requests / p.siblings))
    jobs = []
    for b, t in enumerate(_poisson_times(rng, bursts, p.rate / p.siblings)):
        prompt = _tokens(rng, p.prompt_tokens)
        jobs.append(Job([[RequestSpec(prompt, p.output_tokens, f"burst-{b}") for _ in range(p.siblings)]], t))
    return _trim(jobs, p.num_requests)


def no_reuse(p: WorkloadParams) -> list[Job]:
    """Every prompt unique: cache-aware routing can only cost here, never help."""
    rng = random.Random(p.seed)
    return [Job([[RequestSpec(_tokens(rng, p.prompt_tokens + p.suffix_tokens), p.output_tokens, "none")]], t)
            for t in _poisson_times(rng, p.num_requests, p.rate)]


def trace(p: WorkloadParams) -> list[Job]:
    """Replay a Mooncake JSONL trace. Each hash id becomes a fixed random 16-token chunk, so
    rows sharing a leading run of hash ids share a real prefix. Rows of the original trace
    (512-token blocks) are rescaled like the `_bs16` copies; prompts are capped."""
    if not p.trace:
        raise ValueError("the trace workload needs --trace FILE")
    block = 16
    chunks: dict[int, list[int]] = {}
    jobs = []
    with open(Path(p.trace)) as fh:
        for line in fh:
            if len(jobs) >= p.num_requests:
                break
            row = json.loads(line)
            hids = row["hash_ids"]
            n_in = int(row["input_length"])
            if n_in > len(hids) * block:  # original trace: one id per 512 tokens
                rem = n_in - (len(hids) - 1) * 512
                n_in = (len(hids) - 1) * block + max(1, math.ceil(rem * block / 512))
            prompt: list[int] = []
            for h in hids:
                if h not in chunks:
                    chunks[h] = _tokens(random.Random(f"{p.seed}:{h}"), block)
                prompt += chunks[h]
            prompt = prompt[: min(n_in, p.max_prompt_tokens)]
            out = max(1, min(int(row["output_length"]), p.output_tokens))
            jobs.append(Job([[RequestSpec(prompt, out, f"trace-{hids[0] if hids else 0}")]],
                            row["timestamp"] / 1000.0 * p.trace_time_scale))
    return jobs


def _trim(jobs: list[Job], n: int) -> list[Job]:
    """Keep whole stages until n requests are reached."""
    out, total = [], 0
    for job in sorted(jobs, key=lambda j: j.arrival):
        stages = []
        for stage in job.stages:
            if total >= n:
                break
            stages.append(stage[: n - total])
            total += len(stages[-1])
        if stages:
            out.append(Job(stages, job.arrival, job.think_s))
    return out


WORKLOADS = {"multi_tenant": multi_tenant, "multi_turn": multi_turn, "best_of_n": best_of_n,
             "no_reuse": no_reuse, "trace": trace}


def build(name: str, params: WorkloadParams) -> list[Job]:
    return WORKLOADS[name](params)



def ideal_cached_ratio(jobs: list[Job], block_size: int = 16) -> float:
    """Prompt tokens an unbounded cache shared by all replicas could serve, starting cold, in
    request order: the bound a router could reach (full blocks only, and the engine always
    computes the last prompt token, as the replica's prefix cache does)."""
    seen: set[int] = set()
    cached = total = 0
    for job in jobs:
        for stage in job.stages:
            for r in stage:
                total += len(r.prompt)
                hit, prefix = True, 0
                for end in range(block_size, len(r.prompt), block_size):  # never the last token's block
                    key = hash(tuple(r.prompt[:end]))
                    if hit and key in seen:
                        prefix = end
                    else:
                        hit = False
                        seen.add(key)
                cached += prefix
    return cached / total if total else 0.0
