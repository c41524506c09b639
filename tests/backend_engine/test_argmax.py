"""argmax_rows gives torch.argmax's index in every case greedy sampling can meet."""

import pytest
import torch

from backend_engine.argmax import CHUNK, argmax_rows


@pytest.mark.parametrize("vocab", [49152, 4 * CHUNK, 4 * CHUNK + 1, 5000, 32000 + 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g).to(dtype)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_ties_take_the_first_maximum():
    vocab = 3 * CHUNK + 100 + 4 * CHUNK
    logits = torch.zeros(6, vocab)
    logits[0, [5, CHUNK + 5]] = 3.0  # two chunks, same value: the earlier chunk
    logits[1, [CHUNK + 7, CHUNK + 9]] = 3.0  # one chunk: the earlier place
    logits[2, [vocab - 1, vocab - 2]] = 3.0  # in the short last chunk
    logits[3, vocab - 1] = 3.0  # the very last entry (the padded places repeat it)
    logits[4] = float("-inf")  # all masked: index 0, as argmax gives
    # row 5: all equal -> 0
    expected = logits.argmax(dim=-1)
    assert torch.equal(argmax_rows(logits), expected)
    assert expected.tolist() == [5, CHUNK + 7, vocab - 2, vocab - 1, 0, 0]


def test_nan_counts_as_the_maximum():
    vocab = 8 * CHUNK + 3
    logits = torch.randn(4, vocab)
    logits[0, 3 * CHUNK + 2] = float("nan")
    logits[1, [CHUNK, 6 * CHUNK]] = float("nan")
    logits[2, vocab - 1] = float("nan")
    logits[2, 0] = float("inf")
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_small_vocabularies_and_no_rows_use_argmax_itself():
    logits = torch.randn(3, 100)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(torch.empty(0, 49152)).shape == (0,)


def test_a_strided_view():
    base = torch.randn(6, 49152)
    view = base[::2]
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
