"""What tokenising a chat costs the routing tier (the gateway and the Envoy picker tokenise every
request to hash its prefix): CPU microseconds per request to render and tokenise, the whole
text at once against by pieces with the segment cache (gateway/segment_cache.py), with the
default model's tokenizer, on streams of requests as chat traffic sends them.

    python -m benchmarks.prompt_tokens [--requests 200] [--prompt-tokens 1000 4000 8000]

Streams, at each prompt size:
- `shared_system`: one long system prompt (an agent's instructions, a RAG document), a
  different short user question each request;
- `conversation`: one conversation growing a turn (question and answer) each request, each
  request resending every earlier turn (the prompt size is where it ends);
- `distinct`: a different long system prompt every request: nothing to reuse, what the cache
  costs when it cannot help.
Each request's ids are checked equal both ways. CPU time of this process (`getrusage`), the
fastest of `--rounds` per way, the ways in alternating order; the cache starts empty in every
round and its first requests are also tokenised whole, as in the gateway. Last line is JSON: per stream and size {"whole_us", "pieces_us", "speedup"}."""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource

from benchmarks import results_file
from gateway.segment_cache import SegmentCache
from gateway.tokenizer import LocalTokenizer

MODEL = "SmolLM2-135M-Instruct"


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _text(rng: random.Random, words: list[str], tokens: int) -> str:
    return " ".join(rng.choice(words) for _ in range(int(tokens * 0.28)))  # ~3.6 tokens a word


def _streams(rng: random.Random, words: list[str], n: int, tokens: int) -> dict[str, list[list[dict]]]:
    system = _text(rng, words, tokens)
    shared = [[{"role": "system", "content": system},
               {"role": "user", "content": f"Question {i}: {_text(rng, words, 20)}?"}] for i in range(n)]
    turn_tokens = max(8, tokens // n)
    history: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
    conversation = []
    for i in range(n):
        history = history + [{"role": "user", "content": _text(rng, words, turn_tokens // 4)}]
        conversation.append(history)
        history = history + [{"role": "assistant", "content": _text(rng, words, 3 * turn_tokens // 4)}]
    distinct = [[{"role": "system", "content": _text(rng, words, tokens)},
                 {"role": "user", "content": "Summarise."}] for _ in range(n)]
    return {"shared_system": shared, "conversation": conversation, "distinct": distinct}


def _render(local: LocalTokenizer, messages: list[dict]) -> str:
    return local.template.render(messages=messages, add_generation_prompt=True,
                                 **{k: v for k, v in local.special.items() if v is not None})


def _timed(fn) -> tuple[float, object]:
    gc.collect()
    t0 = _cpu_s()
    out = fn()
    return _cpu_s() - t0, out


def measure(local: LocalTokenizer, chats: list[list[dict]], rounds: int) -> dict:
    """The fastest of `rounds` for each way, the ways in alternating order; the cache starts
    empty in every round."""
    texts = [_render(local, m) for m in chats]  # rendering is the same both ways: not timed
    whole_s = pieces_s = float("inf")
    for round_ in range(rounds):
        cache = SegmentCache(local.tokenizer, local.source)
        ways = [("whole", lambda: [local.tokenizer.encode(t, add_special_tokens=False).ids
                                   for t in texts]),
                ("pieces", lambda: [cache.encode(t) for t in texts])]
        for way, fn in ways if round_ % 2 == 0 else ways[::-1]:
            seconds, ids = _timed(fn)
            if way == "whole":
                whole_s, whole = min(whole_s, seconds), ids
            else:
                pieces_s, pieces = min(pieces_s, seconds), ids
        if pieces != whole or cache.disabled is not None:
            raise SystemExit(f"ids by pieces differ from the whole text's ({cache.disabled})")
    n = len(texts)
    return {"whole_us": round(1e6 * whole_s / n, 1), "pieces_us": round(1e6 * pieces_s / n, 1),
            "speedup": round(whole_s / pieces_s, 2) if pieces_s > 0 else None,
            "prompt_tokens_mean": round(sum(map(len, whole)) / n), "hits": cache.hits,
            "misses": cache.misses}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per stream")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1000, 4000, 8000])
    parser.add_argument("--rounds", type=int, default=3, help="the fastest of this many, per way")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from kvgate.launcher.tokenizer import tokenizer_folder

    local = LocalTokenizer.from_folder(tokenizer_folder(MODEL, None))
    if local.segments.disabled is not None:
        raise SystemExit(f"{MODEL}'s tokenizer is not tokenised by pieces: {local.segments.disabled}")
    rng = random.Random(args.seed)
    words = (__doc__ + " ".join(map(str, range(1000))) + " héllo wörld 日本語 🙂").split()
    out: dict[str, dict] = {}
    for tokens in args.prompt_tokens:
        for stream, chats in _streams(rng, words, args.requests, tokens).items():
            row = measure(local, chats, args.rounds)
            out.setdefault(stream, {})[str(tokens)] = row
            print(f"{stream:14s} {tokens:5d} tokens (mean {row['prompt_tokens_mean']}): whole "
                  f"{row['whole_us']:8.1f} us, by pieces {row['pieces_us']:8.1f} us, "
                  f"x{row['speedup']}", flush=True)
    results_file.write("prompt_tokens", out, {"args": vars(args), "model": MODEL}, argv=argv)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
