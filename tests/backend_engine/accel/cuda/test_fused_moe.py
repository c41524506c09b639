"""The `triton` experts form (accel/cuda/fused_moe.py) against models/moe.py's grouped experts
through the reference Linear: fp, int8 and int4 experts, ragged expert loads, and the whole
engine on a tiny mixture of experts with the form asked for."""

import pytest
import torch

from backend_engine.accel.cuda import weights as cuda
from backend_engine.accel.cuda.fused_moe import (BLOCK_M, StackedExperts, align_by_expert,
                                                 fused_experts, stack_experts)
from backend_engine.models.linear import REFERENCE
from backend_engine.models.moe import Router, grouped_experts
from backend_engine.quant.formats import quantize_int4, quantize_int8

HIDDEN, INTER, EXPERTS, TOP_K = 64, 96, 6, 2


def _experts(fmt: str, device: str, dtype: torch.dtype, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(EXPERTS):
        gate_up = torch.randn(2 * INTER, HIDDEN, generator=g) * 0.1
        down = torch.randn(HIDDEN, INTER, generator=g) * 0.1
        if fmt == "int8":
            pairs.append((cuda.prepare(quantize_int8(gate_up), device),
                          cuda.prepare(quantize_int8(down), device)))
        elif fmt == "int4":
            pairs.append((cuda.prepare(quantize_int4(gate_up, 32), device),
                          cuda.prepare(quantize_int4(down, 32), device)))
        else:
            pairs.append((gate_up.to(device, dtype), down.to(device, dtype)))
    return pairs


def _routed(rows: int, device: str, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=g).to(device, dtype)
    router = torch.randn(EXPERTS, HIDDEN, generator=g).to(device, dtype)
    return x, *Router(TOP_K, renormalise=True, round_weights=False)(x, router)


def test_pairs_are_sorted_by_expert_and_padded_to_whole_tiles():
    top = torch.tensor([[0, 3], [3, 1], [0, 3], [5, 0]])
    sorted_pairs, tile_expert = align_by_expert(top, EXPERTS)
    pairs = top.numel()
    tiles = sorted_pairs.view(-1, BLOCK_M)
    seen = []
    for tile, expert in zip(tiles.tolist(), tile_expert.tolist()):
        real = [p for p in tile if p < pairs]
        if expert < 0:
            assert not real
            continue
        assert all(top.flatten()[p] == expert for p in real)
        seen += real
    assert sorted(seen) == list(range(pairs))
    assert tile_expert.tolist()[:4] == [0, 1, 3, 5]  # experts 2 and 4 took no row


@pytest.mark.parametrize("fmt,dtype", [("fp", torch.float32), ("fp", torch.bfloat16),
                                       ("int8", torch.float32), ("int4", torch.float32),
                                       ("int4", torch.bfloat16)])
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_fused_experts_give_the_grouped_torch_answer(fmt, dtype, rows, device):
    pairs = _experts(fmt, device, dtype)
    stacked = stack_experts(pairs)
    assert isinstance(stacked, StackedExperts)
    x, top_weights, top_experts = _routed(rows, device, dtype)
    want = grouped_experts(x, top_weights, top_experts, pairs, REFERENCE)
    got = fused_experts(x, top_weights, top_experts, stacked, REFERENCE)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # the per-expert views read the stack: the torch path over them gives the same answer
    torch.testing.assert_close(grouped_experts(x, top_weights, top_experts, stacked, REFERENCE),
                               want)


def test_experts_the_kernels_cannot_take_stay_on_the_torch_path(device):
    pairs = _experts("fp", device, torch.float32)
    pairs[2] = (cuda.prepare(quantize_int8(pairs[2][0].cpu()), device), pairs[2][1])
    assert stack_experts(pairs) is pairs  # mixed formats: nothing stacked
    x, top_weights, top_experts = _routed(4, device, torch.float32)
    torch.testing.assert_close(fused_experts(x, top_weights, top_experts, pairs, REFERENCE),
                               grouped_experts(x, top_weights, top_experts, pairs, REFERENCE))


@pytest.mark.parametrize("model", ["tiny-random-mixtral", "tiny-random-qwen3_moe"])
def test_an_engine_with_triton_experts_gives_the_grouped_engines_tokens(model, device):
    pytest.importorskip("transformers")
    from backend_engine.llm import LLM
    from backend_engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(100, 140)), [5, 6, 7], list(range(200, 221))]
    tokens = {}
    for experts in ("grouped", "triton"):
        llm = LLM(model, engine_options={"experts": experts}, device=device, num_kv_blocks=64,
                  enforce_eager=True, target_itl_ms=0)
        assert f"{experts} experts" in llm.engine.runner.forward_pass.describe()
        tokens[experts] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["grouped"]
