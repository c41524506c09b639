"""The whole engine on the Triton backend gives the torch backend's greedy tokens.

Every engine here has a fixed token budget (`target_itl_ms=0`): the latency target's start-up
calibration would time large synthetic steps, which under the interpreter take minutes."""

import pytest

pytest.importorskip("transformers")  # the engine loads configs and tokenizers through it

from backend_engine.llm import LLM  # noqa: E402
from backend_engine.sampling_params import SamplingParams  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SHARED = list(range(100, 140))  # 40 tokens: 2 full blocks reused as a prefix hit
PROMPTS = [SHARED + [7, 8, 9], SHARED + [300], [5], list(range(200, 232)), [11, 12, 13, 14]]


def _greedy(backend: str, device: str, **engine_args) -> list[list[int]]:
    llm = LLM("tiny-random", engine_options={"attention": backend}, device=device,
              num_kv_blocks=64, enforce_eager=True, target_itl_ms=0, **engine_args)
    assert llm.engine.runner.attention.name == backend
    first = llm.generate(PROMPTS, PARAMS)
    again = llm.generate(PROMPTS[:2], PARAMS)  # whole prompts cached now: prefix hits
    assert all(o.num_cached_tokens > 0 for o in again)
    return [o.outputs[0].token_ids for o in first + again]


@pytest.fixture(scope="module")
def torch_tokens():
    return _greedy("torch", "cpu")


def test_triton_engine_matches_torch_engine(torch_tokens, device):
    assert _greedy("triton", device) == torch_tokens


def test_triton_engine_with_small_chunks_matches(torch_tokens, device):
    # a 9-token budget splits prompts into chunks that land mid-block next to decodes
    assert _greedy("triton", device, max_num_batched_tokens=9) == torch_tokens


SPECULATION = [dict(speculative_method="ngram"),
               # the draft model (1 KV head for 4 query heads) runs on the same backend
               dict(speculative_method="draft", draft_model="tiny-random-qwen2")]


@pytest.mark.parametrize("speculation", SPECULATION, ids=["ngram", "draft"])
def test_triton_engine_verifies_drafts_like_torch(speculation, device):
    """Speculative verification is a multi-token chunk over a long cached prefix."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[11, 12, 13, 14] * 6, [5, 6, 7] * 5 + [9]]
    outs = {}
    for backend, dev in (("torch", "cpu"), ("triton", device)):
        llm = LLM("tiny-random", engine_options={"attention": backend}, device=dev,
                  num_kv_blocks=64, enforce_eager=True, target_itl_ms=0,
                  num_speculative_tokens=3, **speculation)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.spec.stats.drafted_tokens > 0
    assert outs["triton"] == outs["torch"]


def test_triton_engine_on_two_tensor_parallel_ranks_matches_torch(torch_tokens, device):
    """Each rank runs the kernels on its own heads (gloo between CPU ranks, NCCL between GPUs)."""
    import torch

    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("tensor parallelism on CUDA needs two GPUs")
    threads = torch.get_num_threads()
    llm = LLM("tiny-random", engine_options={"attention": "triton"}, device=device,
              num_kv_blocks=64, tensor_parallel_size=2, target_itl_ms=0,
              num_threads=1 if device == "cpu" else None)
    try:
        first = llm.generate(PROMPTS, PARAMS)
        again = llm.generate(PROMPTS[:2], PARAMS)
        assert [o.outputs[0].token_ids for o in first + again] == torch_tokens
    finally:
        llm.engine.close()
        torch.set_num_threads(threads)


def test_triton_engine_with_kv_cache_groups_matches_torch(device):
    """Gemma 3's sliding layer reads its own group's tables, null entries before the window
    included (backend_engine/kv_cache_groups.py), on both backends: same tokens, logprobs
    within float32 summation order."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    prompts = [list(range(1000, 1060)), list(range(1000, 1040)) + [7, 8, 9]]
    outs = {}
    for backend, dev in (("torch", "cpu"), ("triton", device)):
        llm = LLM("tiny-random-gemma3", engine_options={"attention": backend}, device=dev,
                  dtype="float32", num_kv_blocks=64, enforce_eager=True, target_itl_ms=0,
                  max_num_batched_tokens=24)
        assert llm.engine.runner.attention.name == backend
        assert len(llm.engine.runner.kv_cache_groups) == 3
        outs[backend] = [o.outputs[0]
                         for o in llm.generate(prompts, params) + llm.generate(prompts, params)]
    for ours, ref in zip(outs["triton"], outs["torch"]):
        assert ours.token_ids == ref.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(ours.logprobs, ref.logprobs)) < 1e-4
