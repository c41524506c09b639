"""The torch attention path (the CPU path and every kernel's reference) against attention written
out per sequence and per head, and the decode grouping it relies on."""

import pytest
import torch

from backend_engine.attention import decode_groups as groups_module
from backend_engine.attention.decode_groups import decode_groups
from backend_engine.attention.torch_backend import TorchAttention
from backend_engine.attention.window import decode_window, window_blocks
from tests.backend_engine.accel.cuda.paged_cases import (naive_attention, random_paged_batch,
                                                      step_metadata)

MIXED = [1, 15, 16, 17, 300, 31, 33, 64, 1000, 65, 100, 999]


def _check(context_lens, num_decodes, query_lens, dtype=torch.float32, atol=2e-5, heads=9,
           kv_heads=3, block_size=16, attention=None, window=0):
    batch = random_paged_batch(context_lens, kv_heads, 64, block_size, dtype, "cpu", seed=3)
    rows = num_decodes + sum(query_lens)
    query = torch.randn(rows, heads, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    meta = step_metadata(batch, num_decodes, query_lens, block_size)
    out = (attention or TorchAttention()).forward(query, batch.k_cache, batch.v_cache, meta, 0.125,
                                                  window)
    expected = naive_attention(query, batch, num_decodes, query_lens, 0.125, window)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=atol)


def test_ragged_decodes_match_the_written_out_attention():
    _check(MIXED, len(MIXED), [])


def test_decodes_and_prefill_chunks_in_one_step():
    # two decodes, a prompt's first chunk, a chunk after a cached prefix, a verify of 1 + 3 drafts
    _check([40, 7, 20, 70, 120], 2, [20, 33, 4])


@pytest.mark.parametrize("window", [1, 16, 40])
def test_a_sliding_window_layer_sees_the_window_up_to_each_query(window):
    # decodes shorter and longer than the window; a fresh prompt longer than it, a chunk after a
    # cached prefix longer than it, a chunk inside it
    _check([7, 40, 300, 20, 70, 120, 30], 3, [20, 33, 4, 5], window=window)


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


class PagedDecode:
    """The decode step's attention (accel/paged_decode.py, compiled inside the step: the
    compiled step is checked against the eager layers in tests/backend_engine/accel/)."""
    name = "paged_decode"

    def __init__(self, cut: bool = True) -> None:
        self.cut = cut  # the tables cut to the window, as the decode step passes them

    def forward(self, query, k_cache, v_cache, meta, scale, window=0):
        from backend_engine.accel.paged_decode import paged_decode

        nd = meta.num_decode_tokens
        out = TorchAttention().forward(query, k_cache, v_cache, meta, scale, window)  # prefills
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if window and self.cut:
            tables, lens = decode_window(tables, lens, window, k_cache.shape[1])
        out[:nd] = paged_decode(query[:nd], k_cache, v_cache, tables, lens, scale, window)
        return out


@pytest.mark.parametrize("lens", [MIXED, [1], [5, 700], [2000, 3, 16, 17] * 5])
def test_the_decode_steps_attention_matches_the_written_out_attention(lens):
    _check(lens, len(lens), [], attention=PagedDecode())
    _check(lens + [40], len(lens), [9], attention=PagedDecode())  # beside a prefill chunk


@pytest.mark.parametrize("window", [1, 16, 40, 512])
@pytest.mark.parametrize("cut", [True, False], ids=["cut", "masked"])
def test_the_decode_steps_window_sees_the_window_up_to_each_query(window, cut):
    _check(MIXED, len(MIXED), [], attention=PagedDecode(cut), window=window)
    _check([2000, 3, 16, 17, 40], 4, [9], attention=PagedDecode(cut), window=window)


@pytest.mark.parametrize("window", [1, 16, 17, 40])
def test_a_decode_window_cuts_each_table_to_the_blocks_it_reads(window):
    lens = torch.tensor(MIXED)
    tables = torch.arange(len(MIXED) * 63).view(len(MIXED), 63)
    cut, cut_lens = decode_window(tables, lens, window, 16)
    assert cut.shape[1] == window_blocks(window, 16) < 63
    for row, (length, cut_length) in enumerate(zip(lens.tolist(), cut_lens.tolist())):
        first = (length - cut_length) // 16  # the row's positions from its first cut block on
        assert (length - cut_length) % 16 == 0 and first * 16 <= max(0, length - window)
        assert cut_length <= cut.shape[1] * 16
        assert torch.equal(cut[row, :-(-cut_length // 16)], tables[row, first:-(-length // 16)])
