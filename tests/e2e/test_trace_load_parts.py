"""benchmarks.trace_load's pieces, without servers: trace rows become chat prompts whose shared
hash ids are shared token prefixes (so the trace's prefix reuse survives the text), and the
report counts finished requests, goodput and rates as the issue defines them."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from backend_engine.model_loader import resolve_model
from benchmarks.serve_bench_client import RequestResult
from benchmarks.trace_load_report import SLO, figures
from benchmarks.trace_load_workload import (conversation_rows, read_rows, single_token_words,
                                            trace_jobs, trace_path)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("default").folder)


def test_shared_hash_ids_are_shared_token_prefixes(tokenizer):
    words = single_token_words(tokenizer)
    path = trace_path("conversation")
    rows = read_rows(path, 60)
    jobs = trace_jobs(path, 60, 3.0, words)
    assert [j.arrival for j in jobs] == pytest.approx([r["timestamp"] / 3000.0 for r in rows])
    encoded = [tokenizer.encode(" " + j.stages[0][0].prompt, add_special_tokens=False)
               for j in jobs]
    for row, tokens in zip(rows, encoded):
        assert len(tokens) == row["input_length"]  # one token per word
    checked = 0
    for a in range(len(rows)):
        for b in range(a):
            ha, hb = rows[a]["hash_ids"], rows[b]["hash_ids"]
            shared = next((i for i, (x, y) in enumerate(zip(ha, hb)) if x != y), min(len(ha), len(hb)))
            if shared and min(len(ha), len(hb)) > shared:
                same = 16 * shared
                assert encoded[a][:same] == encoded[b][:same]
                assert encoded[a][same:same + 16] != encoded[b][same:same + 16]
                checked += 1
    assert checked > 10


def _shared_blocks(a: dict, b: dict) -> int:
    return next((i for i, (x, y) in enumerate(zip(a["hash_ids"], b["hash_ids"])) if x != y),
                min(len(a["hash_ids"]), len(b["hash_ids"])))


def test_whole_conversations_reuse_what_the_trace_s_first_rows_do_not():
    path = trace_path("conversation")
    first = read_rows(path, 40)
    chosen = conversation_rows(path, 40)
    assert len(chosen) == 40
    assert [r["timestamp"] for r in chosen] == sorted(r["timestamp"] for r in chosen)

    def best_earlier(rows):
        return [max((_shared_blocks(r, e) for e in rows[:i]), default=0) for i, r in enumerate(rows)]
    # read in order, the first rows share only the trace's common first block
    assert max(best_earlier(first)) == 1
    # whole conversations: later turns repeat long runs of their earlier turns' blocks
    continued = [n for n in best_earlier(chosen) if n >= 2]
    assert len(continued) >= 10 and sum(continued) / len(continued) > 10
    # the earliest-opening conversations, with every turn but the last one's
    everything = read_rows(path, 1 << 30)
    key = lambda r: tuple(r["hash_ids"][:2])  # noqa: E731
    opened = {}
    for i, r in enumerate(everything):
        opened.setdefault(key(r), i)
    kept = sorted({key(r) for r in chosen}, key=opened.get)
    assert not [k for k, i in opened.items() if i < opened[kept[-1]] and k not in kept]
    for k in kept[:-1]:
        assert sum(key(r) == k for r in chosen) == sum(key(r) == k for r in everything)


def test_goodput_needs_both_the_ttft_and_the_mean_itl_bound():
    def done(ttft, e2e, tokens):
        return RequestResult("g", 0.0, ok=True, ttft=ttft, e2e=e2e, completion_tokens=tokens,
                             prompt_tokens=100, cached_tokens=25,
                             token_times=[ttft + i * (e2e - ttft) / max(1, tokens - 1)
                                          for i in range(tokens)])
    results = [done(1.0, 11.0, 101),  # mean ITL 100 ms: good
               done(12.0, 13.0, 11),  # TTFT over 10 s
               done(2.0, 52.0, 101),  # mean ITL 500 ms
               done(0.5, 0.5, 1),  # one token: no ITL to hold against it
               RequestResult("g", 0.0, error="cut off at the end of the window")]
    f = figures("x", results, window_s=60.0, slo=SLO())
    assert (f.requests, f.finished, f.goodput) == (5, 4, 2)
    assert f.cached_ratio == 0.25
    assert f.errors == {"cut off at the end of the window": 1}
    assert f.out_tok_s == pytest.approx((101 + 11 + 101 + 1) / 52.0, abs=0.01)


def test_the_replicas_hold_as_many_kv_tokens_as_llama_server_unless_told():
    from benchmarks.trace_load import engine_flags, parse_args

    # llama-server's 16 slots x 4,096 tokens, split over kvgate up's 2 CPU replicas, in blocks of 16
    assert engine_flags(parse_args([])) == {"num_kv_blocks": 16 * 4096 // 2 // 16}
    assert engine_flags(parse_args(["--replicas", "4", "--llamacpp-parallel", "8"])) == {
        "num_kv_blocks": 8 * 4096 // 4 // 16}
    for sized in ("num_kv_blocks=300", "kv-cache-memory-gb=2"):
        flags = engine_flags(parse_args(["--engine", sized, "--engine", "dtype=bfloat16"]))
        assert "dtype" in flags and len(flags) == 2
