"""Chat requests from a Mooncake trace (the `_bs16` files: one hash id per 16-token block).

Each hash id becomes 16 words, each a single token of the served model's tokenizer (with its
leading space), chosen by a generator seeded with the id. So two rows that share a leading run of
hash ids share that many blocks of prompt text, token for token, on any server that applies the
same chat template: the prefix-sharing structure of the trace survives, and every server sees
the same text."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from benchmarks.serve_bench_workloads import Job, RequestSpec

BLOCK = 16
TRACES = {  # the copies shipped in benchmarks/data/traces (Apache-2.0, see the README there)
    "conversation": "mooncake_conversation_head2000_bs16.jsonl",
    "synthetic": "mooncake_synthetic_head1000_bs16.jsonl",
}
TRACE_DIR = Path(__file__).resolve().parent / "data" / "traces"


def trace_path(name: str) -> Path:
    """A trace by its short name (conversation, synthetic) or a path to a JSONL file."""
    return TRACE_DIR / TRACES[name] if name in TRACES else Path(name)


def single_token_words(tokenizer) -> list[str]:
    """Lower-case words that the tokenizer encodes as one token after a space, sorted."""
    words = []
    for piece in tokenizer.get_vocab():
        word = piece[1:]
        if piece[0] in "\u0120\u2581" and re.fullmatch(r"[a-z]{3,10}", word):
            if len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1:
                words.append(word)
    if len(words) < 500:
        raise RuntimeError(f"only {len(words)} single-token words in this tokenizer")
    return sorted(words)


def read_rows(path: Path, rows: int) -> list[dict]:
    out = []
    with open(path) as fh:
        for line in fh:
            if len(out) >= rows:
                break
            if line.strip():
                out.append(json.loads(line))
    return out


def conversation_rows(path: Path, rows: int) -> list[dict]:
    """Whole conversations, in the order they open, until `rows` turns (the last one cut short);
    the turns in trace order. A row continues the conversation whose first two blocks it shares
    (every row of the conversation trace shares its first block, a common system prompt); its
    next turn arrives a median of about 100 s later, so the trace's first rows, read in order,
    share nothing more than that first block."""
    everything = read_rows(path, 1 << 30)
    turns: dict[tuple, list[int]] = {}
    for i, row in enumerate(everything):
        key = tuple(row["hash_ids"][:2]) if len(row["hash_ids"]) > 1 else ("alone", i)
        turns.setdefault(key, []).append(i)
    chosen: list[int] = []
    for conversation in sorted(turns.values(), key=lambda c: c[0]):
        chosen += conversation[: rows - len(chosen)]
        if len(chosen) >= rows:
            break
    return [everything[i] for i in sorted(chosen)]


def trace_jobs(path: Path, rows: int, speedup: float, words: list[str], seed: int = 0,
               max_output_tokens: int = 128, max_input_tokens: int | None = None,
               conversations: bool = False) -> list[Job]:
    """One single-request job per row, arriving at timestamp / speedup (seconds); prompts cut
    to `max_input_tokens` keep their shared leading blocks. The rows are the trace's first
    `rows`, or with `conversations` its first whole conversations (`conversation_rows`)."""
    blocks: dict[int, list[str]] = {}
    jobs = []
    for row in (conversation_rows if conversations else read_rows)(path, rows):
        text: list[str] = []
        for h in row["hash_ids"]:
            if h not in blocks:
                rng = random.Random(f"{seed}:{h}")
                blocks[h] = [rng.choice(words) for _ in range(BLOCK)]
            text += blocks[h]
        prompt = " ".join(text[: min(int(row["input_length"]), max_input_tokens or 1 << 30)])
        out = max(1, min(int(row["output_length"]), max_output_tokens))
        group = f"trace-{row['hash_ids'][0] if row['hash_ids'] else 0}"
        jobs.append(Job([[RequestSpec(prompt, out, group)]], row["timestamp"] / 1000.0 / speedup))
    return jobs
