"""Two CPU processes (gloo) give the tokens and logits of one: for each tiny model, with
chunked prefill, preemption, prefix caching (whole and partial blocks) and a draft model on
rank 0; the default model (9 heads, 3 KV heads) on three ranks. Each rank runs one torch
thread."""

from __future__ import annotations

import random

import psutil
import pytest
import torch

from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from backend_engine.sequence import Sequence
from tests.backend_engine.helpers import assert_no_leaks

VOCAB = 49152  # the tiny models borrow SmolLM2's tokenizer
rng = random.Random(19)
SHARED = [rng.randrange(VOCAB) for _ in range(40)]  # a common prefix: prefix caching
PROMPTS = [SHARED + [rng.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 30)] \
    + [[rng.randrange(VOCAB) for _ in range(9)]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
LOGPROB_TOLERANCE = 1e-4  # fp32: the ranks sum partial products in another order
SETTINGS = {  # in test order, so each engine starts once
    "tiny-random-qwen2": dict(num_kv_blocks=64),  # one KV head: replicated on both ranks
    # chunked prefill (32-token budget), preemption (8 blocks for 13 blocks of work) and a
    # draft model, which runs on rank 0 only
    "tiny-random-llama": dict(num_kv_blocks=8, max_num_batched_tokens=32,
                              speculative_method="draft", draft_model="tiny-random",
                              num_speculative_tokens=3),
    "tiny-random-mistral": dict(num_kv_blocks=64),
    "tiny-random-qwen3": dict(num_kv_blocks=64),  # q/k head norms, replicated on both ranks
    "tiny-random-phi3": dict(num_kv_blocks=64),  # fused qkv and gate/up, split before sharding
    "tiny-random-gemma3": dict(num_kv_blocks=64),  # sandwich norms replicated, a sliding window
    # every expert split over its own width, the router replicated; a dense layer beside
    "tiny-random-qwen3_moe": dict(num_kv_blocks=64),
    "tiny-random-mixtral": dict(num_kv_blocks=64),
    "default": dict(num_kv_blocks=64, quantization="none"),  # as default_llm, compared with it
}


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def generate(llm: LLM, prompts=PROMPTS, params=PARAMS):
    outs = llm.generate(prompts, params)
    assert_no_leaks(llm.engine)
    return [o.outputs[0] for o in outs]


def logprobs(output) -> torch.Tensor:
    return torch.tensor([[lp.logprob] + [top[2] for top in lp.top] for lp in output.logprobs])


def stop(llm: LLM) -> None:
    workers = llm.engine.runner.workers
    llm.engine.close()
    assert all(w.exitcode == 0 for w in workers)  # stopped, not killed
    assert not any(psutil.pid_exists(w.pid) for w in workers)


@pytest.fixture(scope="module")
def tensor_parallel():
    """A two-rank engine of the model asked for, kept for the next test that asks for it (one
    tensor-parallel engine per process: the previous one is stopped first)."""
    running: dict[str, LLM] = {}

    def get(model: str, size: int = 2) -> LLM:
        if model not in running:
            for name in list(running):
                stop(running.pop(name))
            running[model] = LLM(model, enforce_eager=True, tensor_parallel_size=size, num_threads=1,
                                 **SETTINGS[model])
        return running[model]
    yield get
    for name in list(running):
        stop(running.pop(name))


def prompt_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position: the prompt's tail rides as drafts to verify."""
    engine = llm.engine
    seq = Sequence("logits", "logits", 0, prompt[:1], PARAMS, "test", 1)
    seq.spec_token_ids = prompt[1:]
    assert engine.kv.allocate_slots(seq, len(prompt))
    try:
        _, logits = engine.runner.forward([(seq, len(prompt))])
    finally:
        engine.kv.free(seq)
    return logits


def test_prompt_logits_of_two_ranks_match_one_rank(tensor_parallel):
    model = "tiny-random-qwen2"  # biases on q/k/v, an untied lm_head, one KV head for two ranks
    expected = prompt_logits(LLM(model, enforce_eager=True, num_threads=1, num_kv_blocks=64), PROMPTS[2])
    got = prompt_logits(tensor_parallel(model), PROMPTS[2])
    assert got.shape == (len(PROMPTS[2]), VOCAB)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model", [m for m in SETTINGS if m.startswith("tiny")])
def test_two_ranks_generate_the_greedy_tokens_and_logprobs_of_one(model, tensor_parallel):
    expected = generate(LLM(model, enforce_eager=True, num_threads=1, num_kv_blocks=64))
    llm = tensor_parallel(model)
    got = generate(llm)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for mine, theirs in zip(got, expected):  # each token's logprob and the top 5 ones
        torch.testing.assert_close(logprobs(mine), logprobs(theirs), atol=LOGPROB_TOLERANCE,
                                   rtol=0)
    if model == "tiny-random-llama":
        stats = llm.engine.stats
        assert stats.preemptions > 0
        spec = llm.engine.spec.stats
        assert spec.drafted_tokens > 0 and spec.accepted_tokens == spec.drafted_tokens
        hits = stats.prefix_cache_hits
        assert [o.token_ids for o in generate(llm, PROMPTS[:2])] == \
            [o.token_ids for o in expected[:2]]
        assert stats.prefix_cache_hits > hits  # block tables are shared: caching is unchanged
    if model == "tiny-random-mistral":  # a partial block hit: every rank copies its shard
        prompt = SHARED[:38] + [7, 8, 9]
        single = LLM(model, enforce_eager=True, num_threads=1, num_kv_blocks=64)
        out = llm.generate([prompt], PARAMS)[0]
        assert out.num_cached_tokens == 38
        assert out.outputs[0].token_ids == single.generate([prompt], PARAMS)[0].outputs[0].token_ids
        assert_no_leaks(llm.engine)


def test_default_model_on_three_ranks_generates_the_tokens_of_one(default_llm, tensor_parallel):
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params)]
    llm = tensor_parallel("default", size=3)  # 3 query heads and 1 KV head per rank
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
