"""Megatron-style shards put back together give the full model's products, and sizes the head
counts do not allow are refused with the reason and the sizes that work."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from backend_engine.distributed.sharding import (check_tensor_parallel_size, shard_layout,
                                                 shard_state_dict, working_sizes)
from backend_engine.errors import ModelLoadError

SMOLLM2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                          intermediate_size=1536, vocab_size=49152)


def config(heads=4, kv_heads=2, hidden=32, intermediate=48, vocab=101):
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads,
                           hidden_size=hidden, intermediate_size=intermediate, vocab_size=vocab)


def layer_weights(cfg, bias=False):
    torch.manual_seed(0)
    d = cfg.hidden_size // cfg.num_attention_heads
    p = "model.layers.0."
    w = {p + "self_attn.q_proj.weight": torch.randn(cfg.num_attention_heads * d, cfg.hidden_size),
         p + "self_attn.k_proj.weight": torch.randn(cfg.num_key_value_heads * d, cfg.hidden_size),
         p + "self_attn.v_proj.weight": torch.randn(cfg.num_key_value_heads * d, cfg.hidden_size),
         p + "self_attn.o_proj.weight": torch.randn(cfg.hidden_size, cfg.num_attention_heads * d),
         p + "mlp.gate_proj.weight": torch.randn(cfg.intermediate_size, cfg.hidden_size),
         p + "mlp.up_proj.weight": torch.randn(cfg.intermediate_size, cfg.hidden_size),
         p + "mlp.down_proj.weight": torch.randn(cfg.hidden_size, cfg.intermediate_size),
         p + "input_layernorm.weight": torch.randn(cfg.hidden_size),
         "model.embed_tokens.weight": torch.randn(cfg.vocab_size, cfg.hidden_size)}
    if bias:
        for name in "qkv":
            w[p + f"self_attn.{name}_proj.bias"] = torch.randn(w[p + f"self_attn.{name}_proj.weight"].shape[0])
    return w


def shards(cfg, size, bias=False):
    return [shard_state_dict(layer_weights(cfg, bias), shard_layout(cfg, rank, size))
            for rank in range(size)]


def test_smollm2_refuses_two_ranks_saying_why_and_accepts_three():
    with pytest.raises(ModelLoadError, match=r"9 attention heads do not split evenly across 2 ranks.*"
                                             r"sizes that work: 1, 3$"):
        check_tensor_parallel_size(SMOLLM2, 2, "SmolLM2-135M-Instruct")
    check_tensor_parallel_size(SMOLLM2, 3)
    layout = shard_layout(SMOLLM2, 2, 3)
    assert (layout.num_heads, layout.num_kv_heads, layout.kv_head_start) == (3, 1, 2)
    assert layout.intermediate_size == 512 and layout.vocab_start == 2 * 16384


def test_sizes_that_split_kv_heads_unevenly_are_refused():
    with pytest.raises(ModelLoadError, match="3 KV heads cannot be replicated evenly across 4"):
        check_tensor_parallel_size(config(heads=12, kv_heads=3, hidden=48), 4)
    check_tensor_parallel_size(config(heads=12, kv_heads=3, hidden=48), 6)  # two ranks per KV head
    with pytest.raises(ModelLoadError, match="MLP width 50"):
        check_tensor_parallel_size(config(intermediate=50), 4)
    with pytest.raises(ModelLoadError, match="at least 1"):
        check_tensor_parallel_size(config(), 0)
    assert working_sizes(config(heads=8, kv_heads=2, hidden=64, intermediate=64)) == [1, 2, 4, 8]


def test_column_and_row_parallel_shards_sum_to_the_full_products():
    cfg = config()
    full = layer_weights(cfg)
    parts = shards(cfg, 2)
    x = torch.randn(3, cfg.hidden_size)
    p = "model.layers.0."
    gate, up, down = (p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down"))
    mlp = F.linear(F.silu(F.linear(x, full[gate])) * F.linear(x, full[up]), full[down])
    summed = sum(F.linear(F.silu(F.linear(x, s[gate])) * F.linear(x, s[up]), s[down]) for s in parts)
    # the shards split each reduction over K in two, so the fp32 sums round differently
    reassociated = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(summed, mlp, **reassociated)
    q, o = p + "self_attn.q_proj.weight", p + "self_attn.o_proj.weight"
    heads_out = torch.randn(3, full[q].shape[0])  # what attention hands to o_proj, per head
    per_rank = heads_out.chunk(2, dim=-1)  # rank r computes its own heads
    torch.testing.assert_close(sum(F.linear(h, s[o]) for h, s in zip(per_rank, parts)),
                               F.linear(heads_out, full[o]), **reassociated)
    torch.testing.assert_close(torch.cat([s[q] for s in parts]), full[q])


def test_fewer_kv_heads_than_ranks_replicates_each_with_its_query_heads_and_bias():
    cfg = config(heads=4, kv_heads=1)
    full = layer_weights(cfg, bias=True)
    k, kb = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.bias"
    qb = "model.layers.0.self_attn.q_proj.bias"
    parts = shards(cfg, 2, bias=True)
    for part in parts:
        torch.testing.assert_close(part[k], full[k])
        torch.testing.assert_close(part[kb], full[kb])
    torch.testing.assert_close(torch.cat([s[qb] for s in parts]), full[qb])


def test_vocabulary_rows_are_split_with_the_last_slice_padded():
    cfg = config(vocab=101)
    full = layer_weights(cfg)["model.embed_tokens.weight"]
    parts = [s["model.embed_tokens.weight"] for s in shards(cfg, 2)]
    assert [p.shape[0] for p in parts] == [51, 51]
    torch.testing.assert_close(torch.cat(parts)[:101], full)
    assert torch.count_nonzero(parts[1][50:]) == 0
    norm = "model.layers.0.input_layernorm.weight"
    assert all(torch.equal(s[norm], layer_weights(cfg)[norm]) for s in shards(cfg, 2))


def test_each_expert_is_split_over_its_own_width_and_the_router_replicated():
    cfg = SimpleNamespace(**vars(config(intermediate=48)), moe_intermediate_size=16)
    torch.manual_seed(0)
    e = "model.layers.0.mlp.experts.3."
    router = "model.layers.0.mlp.gate.weight"
    full = {e + "gate_proj.weight": torch.randn(16, 32), e + "up_proj.weight": torch.randn(16, 32),
            e + "down_proj.weight": torch.randn(32, 16), router: torch.randn(8, 32)}
    parts = [shard_state_dict(dict(full), shard_layout(cfg, rank, 2)) for rank in range(2)]
    assert [tuple(p[e + "down_proj.weight"].shape) for p in parts] == [(32, 8)] * 2
    assert all(torch.equal(p[router], full[router]) for p in parts)

    def mlp(w, x):
        gate, up, down = (w[e + f"{n}_proj.weight"] for n in ("gate", "up", "down"))
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    x = torch.randn(3, 32)
    torch.testing.assert_close(sum(mlp(p, x) for p in parts), mlp(full, x),
                               rtol=1e-5, atol=1e-4)


def test_an_expert_width_the_ranks_do_not_divide_is_refused():
    cfg = SimpleNamespace(**vars(config(intermediate=48)), moe_intermediate_size=50)
    with pytest.raises(ModelLoadError, match="experts' width 50 does not split evenly across 4"):
        check_tensor_parallel_size(cfg, 4)
