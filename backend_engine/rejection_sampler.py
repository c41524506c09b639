"""Lossless verification of drafted tokens (Leviathan et al., 2023).

Greedy: accept while the target's argmax equals the draft. Sampling: accept draft x with
probability min(1, p(x)/q(x)); on rejection draw from normalize(max(p - q, 0)); when every
draft is accepted draw one bonus token from the last position. A deterministic proposer
(n-gram) has q = 1 on its token, so the residual is p with x removed. The output distribution
is exactly the target's."""

from __future__ import annotations

import torch

from backend_engine.argmax import argmax_rows


def verify_greedy(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """target_logits: [len(drafts) + 1, V] processed logits. Returns accepted + 1 tokens."""
    best = argmax_rows(target_logits).tolist()
    out = []
    for i, x in enumerate(drafts):
        if best[i] != x:
            out.append(best[i])
            return out
        out.append(x)
    out.append(best[len(drafts)])
    return out


def verify_sampled(target_probs: torch.Tensor, drafts: list[int],
                   draft_probs: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """target_probs: [k + 1, V]; draft_probs: [k, V] or None (deterministic proposer)."""
    out = []
    uniforms = torch.rand(len(drafts), generator=generator).tolist()
    for i, x in enumerate(drafts):
        p = target_probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        p_x = float(p[x])
        if q_x > 0 and uniforms[i] < min(1.0, p_x / q_x):
            out.append(x)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q: any draw from p is exact
            residual, total = p, float(p.sum())
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    last = target_probs[len(drafts)]
    out.append(int(torch.multinomial(last / last.sum(), 1, generator=generator)))
    return out
