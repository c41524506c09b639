"""The sampler's fast path (a partial top-k instead of sorting the vocabulary, inverse-CDF draws)
gives exactly the distribution of the full sort, and its draws follow that distribution."""

import random

import pytest
import torch

from backend_engine.sampler import Sampler, SamplingRow
from backend_engine.sampling_params import SamplingParams


def _row(**kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), [], [], None, [])


def _dense_reference(sampler, logits, rows):
    """The full-sort path over the same tempered probabilities."""
    return sampler._filtered_dense(sampler._tempered(logits, rows), rows)[0]


@pytest.mark.parametrize("peak", [0.3, 3.0, 12.0])  # flat (nucleus beyond the guess) to peaked
def test_candidate_filter_equals_the_full_sort(peak):
    rng = random.Random(0)
    sampler = Sampler()
    vocab = 5000
    logits = torch.randn(24, vocab, generator=torch.Generator().manual_seed(1)) * peak
    rows = [_row(temperature=rng.choice([0.5, 1.0, 1.3]), top_k=rng.choice([0, 0, 5, 50, 2000]),
                 top_p=rng.choice([1.0, 0.9, 0.5, 0.99]), min_p=rng.choice([0.0, 0.0, 0.05]))
            for _ in range(24)]
    rows[0] = _row(temperature=1.0, top_p=0.95)  # top-p only
    got = sampler.probs(logits, rows)
    want = _dense_reference(sampler, logits, rows)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_rows_without_filters_keep_the_whole_distribution():
    sampler = Sampler()
    logits = torch.randn(3, 100)
    probs, candidates = sampler._filtered(logits, [_row(temperature=1.0)] * 3)
    assert candidates is None
    torch.testing.assert_close(probs, torch.softmax(logits, -1))


@pytest.mark.parametrize("filters", [{}, {"top_k": 3}, {"top_p": 0.7}])
def test_draws_follow_the_filtered_distribution(filters):
    sampler = Sampler(seed=3)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    rows = [_row(temperature=1.0, **filters)] * 4000
    tokens = sampler._sample(logits.repeat(4000, 1), rows)
    freq = torch.bincount(tokens, minlength=6).float() / 4000
    want = sampler.probs(logits, rows[:1])[0]
    want = want / want.sum()
    assert (freq[want == 0] == 0).all()
    assert torch.allclose(freq, want, atol=0.03)


def test_a_seeded_row_draws_the_same_whatever_its_neighbours():
    logits = torch.randn(5, 5000, generator=torch.Generator().manual_seed(7)) * 4

    def seeded(seed: int = 42) -> SamplingRow:
        return SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), [], [],
                           torch.Generator().manual_seed(seed), [])

    firsts = set()
    for seed in range(20):
        alone = Sampler(seed=1)._sample(logits[:1], [seeded(seed)])
        crowd = Sampler(seed=2)._sample(logits, [seeded(seed)] + [_row(temperature=1.0, top_k=7)] * 4)
        # a flat neighbour whose nucleus is wider than the guess sends the batch to the full sort
        flat = torch.cat([logits[:1], torch.zeros(1, 5000)])
        wide = Sampler(seed=3)._sample(flat, [seeded(seed), _row(temperature=1.0, top_p=0.999)])
        unfiltered = Sampler(seed=4)._sample(logits[:2], [seeded(seed), _row(temperature=1.0)])
        assert alone[0] == crowd[0] == wide[0] == unfiltered[0]
        firsts.add(int(alone[0]))
    assert len(firsts) > 1  # the seeds do matter
