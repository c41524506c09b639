"""Batched speculative acceptance: the same tokens as a per-row reference given the same random
draws, and the target's distribution whatever the draft's (losslessness)."""

import pytest
import torch

from backend_engine.kernels.rejection import rejection_sample


def _reference_row(drafts, p, q, greedy, uniforms, noise, bonus):
    """spec_decode/rejection.py's rule with the kernel's draws: an exponential race for the
    residual instead of torch.multinomial."""
    out = []
    for i, x in enumerate(drafts):
        if greedy:
            best = int(p[i].argmax())
            out.append(best)
            if best != x:
                return out
            continue
        q_i = q[i] if q is not None else torch.nn.functional.one_hot(
            torch.tensor(x), p.shape[1]).float()
        if q_i[x] > 0 and uniforms[i] * q_i[x] < p[i, x]:
            out.append(x)
            continue
        residual = (p[i] - q_i).clamp_min(0)
        race = residual if residual.max() > 0 else p[i]
        out.append(int((race / noise[i]).argmax()))
        return out
    return out + [bonus]


def _batch(num_drafts, vocab, with_draft_probs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(num_drafts)
    target = torch.softmax(torch.randn(total, vocab, generator=gen) * 2, -1)
    draft = torch.softmax(torch.randn(total, vocab, generator=gen) * 2, -1) \
        if with_draft_probs else None
    # drafts agree with the target's argmax half the time so rows run to different lengths
    drafts = torch.where(torch.rand(total, generator=gen) < 0.5, target.argmax(-1),
                         torch.randint(vocab, (total,), generator=gen))
    return target, draft, drafts, gen


@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize("vocab", [50, 3000])  # one vocabulary tile and several
def test_matches_per_row_reference(with_draft_probs, vocab, device):
    num_drafts = [3, 0, 1, 4, 2, 4]
    target, draft, drafts, gen = _batch(num_drafts, vocab, with_draft_probs)
    greedy = torch.tensor([False, False, True, False, True, False])
    bonus = torch.arange(len(num_drafts)) + 7
    uniforms = torch.rand(len(drafts), generator=gen)
    noise = torch.empty(len(drafts), vocab).exponential_(generator=gen)
    to = (lambda t: None if t is None else t.to(device))
    out = rejection_sample(drafts.to(device), num_drafts, target.to(device), to(draft),
                           bonus.to(device), greedy.to(device), uniforms=uniforms.to(device),
                           noise=noise.to(device)).cpu()
    start = 0
    for row, n in enumerate(num_drafts):
        sl = slice(start, start + n)
        expected = _reference_row(drafts[sl].tolist(), target[sl],
                                  draft[sl] if draft is not None else None, bool(greedy[row]),
                                  uniforms[sl], noise[sl], int(bonus[row]))
        assert out[row].tolist() == expected + [-1] * (out.shape[1] - len(expected))
        start += n


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_first_token_follows_the_target_distribution(with_draft_probs, device):
    """Lossless: with drafts drawn from q, the first emitted token is distributed as p."""
    rows, vocab = 800, 6
    p = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    q = torch.tensor([0.4, 0.05, 0.3, 0.05, 0.1, 0.1]) if with_draft_probs else None
    gen = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q, rows, replacement=True, generator=gen) if q is not None \
        else torch.full((rows,), 2)  # a fixed n-gram guess
    target = p.expand(rows, vocab).contiguous()
    draft = q.expand(rows, vocab).contiguous().to(device) if q is not None else None
    out = rejection_sample(drafts.to(device), [1] * rows, target.to(device), draft,
                           torch.zeros(rows, dtype=torch.long, device=device),
                           torch.zeros(rows, dtype=torch.bool, device=device),
                           generator=torch.Generator(device).manual_seed(2))
    freq = torch.bincount(out[:, 0].cpu(), minlength=vocab).float() / rows
    # 800 draws: one standard error is at most 0.018; a residual that ignores q is off by >0.09
    torch.testing.assert_close(freq, p, atol=0.04, rtol=0)
