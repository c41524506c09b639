"""The torch attention path (the CPU path and every kernel's reference) against attention written
out per sequence and per head, and the decode grouping it relies on."""

import pytest
import torch

from backend_engine.attention import decode_groups as groups_module
from backend_engine.attention.decode_groups import decode_groups
from backend_engine.attention.torch_backend import TorchAttention
from tests.backend_engine.kernels.paged_cases import (naive_attention, random_paged_batch,
                                                      step_metadata)

MIXED = [1, 15, 16, 17, 300, 31, 33, 64, 1000, 65, 100, 999]


def _check(context_lens, num_decodes, query_lens, dtype=torch.float32, atol=2e-5, heads=9,
           kv_heads=3, block_size=16, attention=None):
    batch = random_paged_batch(context_lens, kv_heads, 64, block_size, dtype, "cpu", seed=3)
    rows = num_decodes + sum(query_lens)
    query = torch.randn(rows, heads, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    meta = step_metadata(batch, num_decodes, query_lens, block_size)
    out = (attention or TorchAttention()).forward(query, batch.k_cache, batch.v_cache, meta, 0.125)
    expected = naive_attention(query, batch, num_decodes, query_lens, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=atol)


def test_ragged_decodes_match_the_written_out_attention():
    _check(MIXED, len(MIXED), [])


def test_decodes_and_prefill_chunks_in_one_step():
    # two decodes, a prompt's first chunk, a chunk after a cached prefix, a verify of 1 + 3 drafts
    _check([40, 7, 20, 70, 120], 2, [20, 33, 4])


@pytest.mark.parametrize("group_bytes", [1, 4096, 1 << 30])
def test_grouping_does_not_change_the_answer(monkeypatch, group_bytes):
    monkeypatch.setattr(groups_module, "MAX_GROUP_BYTES", group_bytes)
    _check(MIXED, len(MIXED), [])


def test_bfloat16_close_to_the_written_out_attention():
    _check(MIXED + [30], len(MIXED), [7], dtype=torch.bfloat16, atol=3e-2)


def test_every_row_lands_in_exactly_one_group_with_little_padding():
    lens = [5, 2000, 480, 500, 510, 1990, 33, 16, 17, 1000]
    tables = torch.arange(len(lens) * 125).view(len(lens), 125)
    found = decode_groups(tables, torch.tensor(lens), 16, 1536, torch.device("cpu"),
                          torch.float32, max_group_bytes=1 << 40)
    rows = sorted(r for g in found for r in g.rows.tolist())
    assert rows == list(range(len(lens)))
    for g in found:
        group_lens = [lens[r] for r in g.rows.tolist()]
        width = g.block_tables.shape[1] * 16
        assert width == -(-max(group_lens) // 16) * 16
        assert min(group_lens) >= 0.75 * width or len(group_lens) == 1
        assert torch.equal(g.block_tables, tables[g.rows][:, :g.block_tables.shape[1]])


def test_a_group_holds_at_most_the_byte_budget_unless_a_row_alone_exceeds_it():
    lens = [1000] * 8
    tables = torch.zeros(8, 63, dtype=torch.long)
    found = decode_groups(tables, torch.tensor(lens), 16, 1000, torch.device("cpu"),
                          torch.float32, max_group_bytes=3 * 1008 * 1000)
    assert [len(g.rows) for g in found] == [3, 3, 2]
    alone = decode_groups(tables, torch.tensor(lens), 16, 1000, torch.device("cpu"),
                          torch.float32, max_group_bytes=10)
    assert len(alone) == 8


def test_an_unpadded_batch_in_order_is_one_group_without_mask():
    tables = torch.arange(6).view(2, 3)
    found = decode_groups(tables, torch.tensor([48, 48]), 16, 1536, torch.device("cpu"),
                          torch.float32)
    assert len(found) == 1 and found[0].rows is None and found[0].bias is None


@pytest.fixture(scope="module")
def compiled_attention():
    """TorchAttention with the compiled decode kernel (compiled once for the module's shapes)."""
    attention = TorchAttention()
    cache = torch.zeros(64, 16, 3, 64)
    assert attention.use_compiled_decode(cache, cache, 9, 0.125), "compiled decode failed here"
    return attention


@pytest.mark.parametrize("lens", [MIXED, [1], [5, 700], [16] * 16, [2000, 3, 16, 17] * 5])
def test_compiled_decode_matches_the_written_out_attention(compiled_attention, lens):
    # one row, one block: padded to two of each (no 0/1 specialisation); equal sizes (16 rows
    # of 16 tokens in blocks of 16) would be unified by a duck-sized compile, never here
    _check(lens, len(lens), [], attention=compiled_attention)
    _check(lens + [40], len(lens), [9], attention=compiled_attention)  # with a prefill chunk
    assert compiled_attention.compiled is not None


def test_compiled_decode_in_bfloat16(compiled_attention):
    attention = TorchAttention()
    cache = torch.zeros(64, 16, 3, 64, dtype=torch.bfloat16)
    assert attention.use_compiled_decode(cache, cache, 9, 0.125)
    _check(MIXED, len(MIXED), [], dtype=torch.bfloat16, atol=3e-2, attention=attention)


def test_compiled_decode_never_recompiles_across_batch_shapes(compiled_attention):
    from torch._dynamo.utils import counters

    _check([30, 9], 2, [], attention=compiled_attention)  # compiled for these shapes by now
    before = sum(counters["stats"].values())
    for lens in ([3, 900, 17], [64] * 40, [1], [16, 16], [200] * 7 + [5]):
        _check(lens, len(lens), [], attention=compiled_attention)
    assert sum(counters["stats"].values()) == before


def test_a_kernel_that_cannot_compile_leaves_eager_decode(monkeypatch):
    from backend_engine.attention import compiled_decode

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    attention = TorchAttention()
    cache = torch.zeros(8, 16, 3, 64)
    monkeypatch.setattr(compiled_decode, "paged_decode", broken)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    assert not attention.use_compiled_decode(cache, cache, 9, 0.125)
    assert attention.compiled is None
    _check(MIXED, len(MIXED), [], attention=attention)


def test_an_engine_with_compiled_decode_answers_as_the_eager_one():
    from backend_engine.llm import LLM
    from backend_engine.sampling_params import SamplingParams

    prompts = ["a long way " * 40, "short", "x y z " * 90]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    from torch._dynamo.utils import counters

    answers = []
    for mode in ("off", "on"):
        before = counters["stats"]["unique_graphs"]
        llm = LLM("tiny-random", num_kv_blocks=128, compile_attention=mode)
        assert (llm.engine.runner.attention.compiled is not None) == (mode == "on")
        answers.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        # compiled once, at start-up: no step recompiles it
        assert counters["stats"]["unique_graphs"] - before == (mode == "on")
    assert answers[0] == answers[1]
