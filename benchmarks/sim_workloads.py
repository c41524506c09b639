"""Workloads for the routing simulator. Prompts are real token-id lists hashed with the
canonical block hash, so the real index sees exactly what a gateway would."""

from __future__ import annotations

import json
import random
from array import array
from pathlib import Path

from benchmarks.sim_replica import SimRequest
from routing.hashing import block_hashes

MODEL = "sim-model"
VOCAB = 50_000


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _request(arrival: float, tokens: list[int], output: int, bs: int, ns: str = MODEL,
             session: str | None = None) -> SimRequest:
    return SimRequest(arrival, block_hashes(tokens, ns, bs), len(tokens), output, session,
                      token_ids=array("I", tokens))


def multi_tenant(rng: random.Random, n: int, rate: float, bs: int, tenants: int = 24,
                 system_tokens: int = 2048, question_tokens: int = 96,
                 zipf_s: float = 0.3) -> list[SimRequest]:
    """(a) T tenants, each a long system prompt shared by many users; Poisson arrivals."""
    prompts = [_tokens(rng, system_tokens) for _ in range(tenants)]
    weights = [1 / (i + 1) ** zipf_s for i in range(tenants)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        tenant = rng.choices(range(tenants), weights)[0]
        question = _tokens(rng, rng.randint(question_tokens // 2, question_tokens * 3 // 2))
        out.append(_request(t, prompts[tenant] + question, rng.randint(32, 96), bs,
                            session=f"user-{tenant}-{rng.randrange(50)}"))
    return out


def multi_turn(rng: random.Random, n: int, rate: float, bs: int, turns: int = 12,
               first_tokens: int = 256, turn_tokens: int = 64,
               think_s: float = 4.0) -> list[SimRequest]:
    """(b) chats: each turn resends the whole conversation plus the answer and a new message;
    sessions start uniformly over the run, so about 30 are live at a time."""
    sessions = max(1, n // turns)
    starts = sorted(rng.uniform(0, n / rate) for _ in range(sessions))
    out: list[SimRequest] = []
    for s, start in enumerate(starts):
        history = _tokens(rng, first_tokens)
        t = start
        for _ in range(turns):
            out.append(_request(t, list(history), 64, bs, session=f"chat-{s}"))
            history += _tokens(rng, 64) + _tokens(rng, turn_tokens)  # answer + next user turn
            t += 1.5 + rng.expovariate(1 / think_s)
    out.sort(key=lambda r: r.arrival)
    return out[:n]


def best_of_n(rng: random.Random, n: int, rate: float, bs: int, siblings: int = 8,
              prompt_tokens: int = 1024) -> list[SimRequest]:
    """(c) bursts of N identical prompts sent together (best-of-N, agent fan-out)."""
    t, out = 0.0, []
    while len(out) < n:
        t += rng.expovariate(rate / siblings)
        prompt = _tokens(rng, prompt_tokens)
        out.extend(_request(t, prompt, 64, bs) for _ in range(siblings))
    return out[:n]


def no_reuse(rng: random.Random, n: int, rate: float, bs: int,
             prompt_tokens: int = 1024) -> list[SimRequest]:
    """(d) every prompt unique: cache awareness can only cost, never help."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(_request(t, _tokens(rng, rng.randint(prompt_tokens // 2, prompt_tokens * 3 // 2)),
                            rng.randint(32, 96), bs))
    return out


def mooncake_trace(path: Path, bs: int, time_scale: float = 1.0,
                   limit: int | None = None) -> list[SimRequest]:
    """(e) a Mooncake JSONL trace; each hash_id stands for one block of `bs` tokens (the _bs16
    files), turned into deterministic token ids so shared hash_id runs share real hashes."""
    out = []
    with open(path) as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                break
            row = json.loads(line)
            tokens: list[int] = []
            for hid in row["hash_ids"]:
                tokens.extend((hid * bs + j) % (2**32) for j in range(bs))
            tokens = tokens[: row["input_length"]]
            out.append(_request(row["timestamp"] / 1000.0 * time_scale, tokens,
                                max(1, row["output_length"]), bs))
    return out
