"""Speculative-decoding acceptance for a whole batch on the GPU (Leviathan et al., 2023), the
batched counterpart of spec_decode/rejection.py.

Draft token x at a position is accepted with probability min(1, p(x)/q(x)) (q = 1 on x for a
deterministic proposer such as n-gram); greedy rows accept while x is the target's argmax. The
first rejection emits a token drawn from normalize(max(p - q, 0)), after which the row stops;
a row that accepts every draft emits its bonus token (sampled by the regular sampler from the
last position). Residual draws are exponential races, argmax(r / E) with E ~ Exp(1), so a whole
vocabulary row is one pass and needs no normalisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend_engine.kernels.common import KernelInputError, check_device

BLOCK_V = 1024
NO_TOKEN = -1  # output padding after a row's last emitted token


@triton.jit
def _recovered_kernel(target_probs_ptr, draft_probs_ptr, draft_ids_ptr, noise_ptr, out_ptr,
                      vocab, HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    x = tl.load(draft_ids_ptr + t)
    best_res = tl.full([BLOCK_V], -1.0, tl.float32)
    best_res_id = tl.zeros([BLOCK_V], tl.int64)
    best_p = tl.full([BLOCK_V], -1.0, tl.float32)
    best_p_id = tl.zeros([BLOCK_V], tl.int64)
    for start in range(0, vocab, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        mask = v < vocab
        p = tl.load(target_probs_ptr + t * vocab + v, mask=mask, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + t * vocab + v, mask=mask, other=0.0)
        else:
            q = tl.where(v == x, 1.0, 0.0)
        noise = tl.load(noise_ptr + t * vocab + v, mask=mask, other=1.0)
        res = tl.where(mask, tl.maximum(p - q, 0.0) / noise, -1.0)
        race = tl.where(mask, p / noise, -1.0)
        better = res > best_res
        best_res = tl.where(better, res, best_res)
        best_res_id = tl.where(better, v, best_res_id)
        better = race > best_p
        best_p = tl.where(better, race, best_p)
        best_p_id = tl.where(better, v, best_p_id)
    top_res = tl.max(best_res, 0)
    res_id = tl.min(tl.where(best_res == top_res, best_res_id, vocab), 0)
    p_id = tl.min(tl.where(best_p == tl.max(best_p, 0), best_p_id, vocab), 0)
    # p == q leaves no residual mass; then any draw from p is exact
    tl.store(out_ptr + t, tl.where(top_res > 0, res_id, p_id))


@triton.jit
def _accept_kernel(draft_ids_ptr, draft_starts_ptr, num_drafts_ptr, target_probs_ptr,
                   draft_probs_ptr, uniforms_ptr, recovered_ptr, argmax_ptr, greedy_ptr,
                   bonus_ptr, out_ptr, vocab, out_stride, HAS_DRAFT_PROBS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.load(draft_starts_ptr + row).to(tl.int64)
    num = tl.load(num_drafts_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    alive = tl.full([], 1, tl.int32)
    for i in range(0, num):
        t = start + i
        x = tl.load(draft_ids_ptr + t)
        p_x = tl.load(target_probs_ptr + t * vocab + x)
        if HAS_DRAFT_PROBS:
            q_x = tl.load(draft_probs_ptr + t * vocab + x)
        else:
            q_x = tl.full([], 1.0, tl.float32)
        sampled_ok = (q_x > 0) & (tl.load(uniforms_ptr + t) * q_x < p_x)
        best = tl.load(argmax_ptr + t)
        ok = tl.where(greedy, best == x, sampled_ok)
        token = tl.where(ok, x, tl.where(greedy, best, tl.load(recovered_ptr + t)))
        tl.store(out_ptr + row * out_stride + i, token, mask=alive != 0)
        alive = alive * ok.to(tl.int32)
    tl.store(out_ptr + row * out_stride + num, tl.load(bonus_ptr + row), mask=alive != 0)


def rejection_sample(draft_token_ids: torch.Tensor, num_drafts: list[int],
                     target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     bonus_token_ids: torch.Tensor, greedy: torch.Tensor,
                     generator: torch.Generator | None = None,
                     uniforms: torch.Tensor | None = None,
                     noise: torch.Tensor | None = None) -> torch.Tensor:
    """Verify every row's drafts at once.

    draft_token_ids [T] (rows' drafts back to back, num_drafts[i] each); target_probs [T, V]
    and draft_probs [T, V] (None: deterministic proposer) at those positions; bonus_token_ids
    [B]; greedy [B] bool. uniforms [T] and noise [T, V] (Exp(1)) are drawn from generator
    unless given. Returns [B, max(num_drafts) + 1] int64: each row's emitted tokens (accepted
    drafts, then one recovered or bonus token), padded with -1.
    """
    total, batch = sum(num_drafts), len(num_drafts)
    if draft_token_ids.shape != (total,) or target_probs.dim() != 2 \
            or target_probs.shape[0] != total:
        raise KernelInputError("draft_token_ids and target_probs need one row per draft")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise KernelInputError("draft_probs must match target_probs")
    if bonus_token_ids.shape != (batch,) or greedy.shape != (batch,):
        raise KernelInputError("bonus_token_ids and greedy need one entry per row")
    device, vocab = target_probs.device, target_probs.shape[1]
    check_device(draft_token_ids, target_probs, bonus_token_ids, greedy)
    target_probs = target_probs.float().contiguous()
    draft_probs = draft_probs.float().contiguous() if draft_probs is not None else None
    if uniforms is None:
        uniforms = torch.rand(total, generator=generator, device=device)
    if noise is None:
        noise = torch.empty_like(target_probs).exponential_(generator=generator)
    counts = torch.tensor(num_drafts, dtype=torch.int32)
    starts = (torch.cumsum(counts, 0) - counts).to(device)
    out = torch.full((batch, max(num_drafts, default=0) + 1), NO_TOKEN, dtype=torch.int64,
                     device=device)
    if batch == 0:
        return out
    drafts = draft_token_ids.to(torch.int64)
    recovered = torch.empty(max(total, 1), dtype=torch.int64, device=device)
    probs_or_dummy = draft_probs if draft_probs is not None else target_probs
    if total:
        _recovered_kernel[(total,)](target_probs, probs_or_dummy, drafts, noise.contiguous(),
                                    recovered, vocab, HAS_DRAFT_PROBS=draft_probs is not None,
                                    BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)))
    argmax = target_probs.argmax(dim=-1) if total else recovered
    _accept_kernel[(batch,)](drafts, starts, counts.to(device), target_probs, probs_or_dummy,
                             uniforms, recovered, argmax, greedy.to(torch.int8),
                             bonus_token_ids.to(torch.int64), out, vocab, out.stride(0),
                             HAS_DRAFT_PROBS=draft_probs is not None)
    return out
