"""A mixture of experts' two matmuls as grouped Triton kernels (the `triton` experts form): every
expert's weights stacked into one tensor per projection, a step's (row, expert) pairs sorted by
expert and padded to whole row tiles, and one launch per projection in which each tile of rows
multiplies its expert's weights. The torch path (models/moe.py, `grouped_experts`) runs each
active expert once through the Linear instead, a launch per expert and projection; this form
gives its answer within the tolerances of the dtype (the sum over a row's k experts runs in
fp32 here, in the activations' dtype there).

Tiles multiply in the activations' dtype with fp32 sums (in fp32 under Triton's CPU interpreter,
whose bf16 dot is wrong). Weights: the compute dtype (fp), or int8 per output channel, or int4 in groups (the canonical
layouts of quant/formats.py as the per-weight Triton kernels read them); int4 weights with an
act-order permutation, or experts of mixed formats, stay on the torch path.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from backend_engine.accel.cuda.common import check_device, dot_precision, interpreting
from backend_engine.accel.cuda.weights import TritonInt4Weight, TritonInt8Weight
from backend_engine.models.linear import Linear
from backend_engine.models.moe import grouped_experts
from backend_engine.quant.formats import Int4Weight

BLOCK_M = 16  # rows of one tile: a step's pairs per expert are padded to a multiple of it
_TILES = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4)
FP, INT8, INT4 = 0, 1, 2


@dataclass(slots=True, eq=False)
class StackedWeight:
    """One projection of every expert: values [E, N, K] (int4: [E, N, K/2]), scales [E, N]
    (int4: [E, N, K/group], with mins beside)."""
    fmt: int
    values: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    group: int = 1

    @property
    def out_features(self) -> int:
        return self.values.shape[1]


@dataclass(slots=True, eq=False)
class StackedExperts(Sequence):
    """A layer's experts as (gate/up, down) pairs, each a view into the stacked weights, so the
    torch path and the fused kernels read the same memory."""
    gate_up: StackedWeight
    down: StackedWeight
    pairs: list

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - Sequence's own signature
        return self.pairs[i]

    def __len__(self) -> int:
        return len(self.pairs)

    def __iter__(self) -> Iterator:
        return iter(self.pairs)


def _stack(weights: list) -> tuple[StackedWeight, list] | None:
    """The weights stacked, and per-expert weights viewing the stack; None where the kernels
    cannot take them (mixed formats, act-order int4)."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        values = torch.stack(weights)
        return StackedWeight(FP, values), list(values.unbind(0))
    if all(isinstance(w, TritonInt8Weight) for w in weights):
        values = torch.stack([w.qweight for w in weights])
        scales = torch.stack([w.scales for w in weights])
        return (StackedWeight(INT8, values, scales),
                [TritonInt8Weight(q, s) for q, s in zip(values, scales)])
    if all(isinstance(w, TritonInt4Weight) and w.weight.perm is None for w in weights):
        group = weights[0].weight.group_size
        if any(w.weight.group_size != group for w in weights):
            return None
        values, scales, mins = (torch.stack([getattr(w.weight, f) for w in weights])
                                for f in ("qweight", "scales", "mins"))
        return (StackedWeight(INT4, values, scales, mins, group),
                [TritonInt4Weight(Int4Weight(q, s, m, group, None))
                 for q, s, m in zip(values, scales, mins)])
    return None


def stack_experts(pairs: list) -> StackedExperts | list:
    """A layer's per-expert (gate/up, down) weights as StackedExperts, or as given where the
    fused kernels cannot take them."""
    gate_up, down = _stack([p[0] for p in pairs]), _stack([p[1] for p in pairs])
    if gate_up is None or down is None:
        return pairs
    return StackedExperts(gate_up[0], down[0], list(zip(gate_up[1], down[1])))


def align_by_expert(top_experts: torch.Tensor, num_experts: int,
                    block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's (row, expert) pairs (index row * k + slot) sorted by expert, each expert's run
    padded to a multiple of `block_m` with the sentinel T*k, and each tile's expert (-1 for the
    tiles past the last run). Sized by the worst case, so nothing waits for the device."""
    flat = top_experts.flatten()
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    run_start = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts
    experts = flat[order]
    slots = run_start[experts] + torch.arange(pairs, device=flat.device) - first[experts]
    tiles = triton.cdiv(pairs + num_experts * (block_m - 1), block_m)
    sorted_pairs = torch.full((tiles * block_m,), pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[slots] = order.to(torch.int32)
    tile_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded // block_m)
    tile_expert = F.pad(tile_expert, (0, tiles - tile_expert.numel()), value=-1)
    return sorted_pairs, tile_expert.to(torch.int32)


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, scale_ptr, min_ptr, out_ptr, pair_weight_ptr, sorted_ptr,
                    tile_expert_ptr, pairs, N, K, stride_am, stride_we, stride_wn, stride_se,
                    stride_sn, stride_om, A_ROW_DIV: tl.constexpr, FMT: tl.constexpr,
                    GROUP: tl.constexpr, WEIGHTED: tl.constexpr, UPCAST: tl.constexpr,
                    PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert = tl.load(tile_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    pair = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < pairs
    a_row = pair // A_ROW_DIV
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[None, :] & k_ok[:, None]
        if FMT == 2:  # int4: two values a byte, low nibble first; w = q * scale + min
            packed = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] // 2,
                             mask=w_mask, other=0)
            q = (packed >> ((offs_k[:, None] % 2) * 4).to(tl.uint8)) & 0xF
            group = (expert.to(tl.int64) * stride_se + offs_n[None, :] * stride_sn
                     + offs_k[:, None] // GROUP)
            w = (q.to(tl.float32) * tl.load(scale_ptr + group, mask=w_mask, other=0.0)
                 + tl.load(min_ptr + group, mask=w_mask, other=0.0))
        else:
            w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask,
                        other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
    if FMT == 1:  # int8: one scale per output channel
        acc *= tl.load(scale_ptr + expert.to(tl.int64) * stride_se + offs_n, mask=n_ok,
                       other=0.0)[None, :]
    if WEIGHTED:
        acc *= tl.load(pair_weight_ptr + pair, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def grouped_matmul(a: torch.Tensor, w: StackedWeight, sorted_pairs: torch.Tensor,
                   tile_expert: torch.Tensor, pairs: int, a_row_div: int,
                   pair_weights: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out [pairs, N]: pair p's row (a[p // a_row_div]) times its expert's weight, scaled by
    pair_weights[p] when given."""
    a = a.contiguous()
    n = w.out_features
    k = a.shape[1]
    out = torch.empty(pairs, n, dtype=out_dtype or a.dtype, device=a.device)
    check_device(a, w.values, sorted_pairs, tile_expert)
    scales = w.scales if w.scales is not None else w.values
    mins = w.mins if w.mins is not None else scales
    grid = (tile_expert.numel(), triton.cdiv(n, _TILES["BLOCK_N"]))
    _grouped_kernel[grid](
        a, w.values, scales, mins, out, pair_weights if pair_weights is not None else out,
        sorted_pairs, tile_expert, pairs, n, k, a.stride(0), w.values.stride(0),
        w.values.stride(1), scales.stride(0), scales.stride(1) if scales.dim() > 2 else 0,
        out.stride(0), A_ROW_DIV=a_row_div, FMT=w.fmt, GROUP=w.group,
        WEIGHTED=pair_weights is not None, UPCAST=a.dtype == torch.float32 or interpreting(),
        PRECISION=dot_precision(a.dtype), BLOCK_M=BLOCK_M,
        **_TILES)
    return out


def fused_experts(x: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor,
                  experts, linear: Linear) -> torch.Tensor:
    """The `triton` experts form: models/moe.py's grouped_experts as two grouped launches;
    experts the kernels cannot take (not StackedExperts) go the torch path."""
    if not isinstance(experts, StackedExperts) or x.shape[0] == 0:
        return grouped_experts(x, top_weights, top_experts, experts, linear)
    rows, k = top_experts.shape
    pairs = rows * k
    sorted_pairs, tile_expert = align_by_expert(top_experts, len(experts))
    gate_up = grouped_matmul(x, experts.gate_up, sorted_pairs, tile_expert, pairs, k)
    gate, up = gate_up.chunk(2, dim=-1)
    down = grouped_matmul(F.silu(gate) * up, experts.down, sorted_pairs, tile_expert, pairs, 1,
                          top_weights.flatten().float().contiguous(), torch.float32)
    return down.view(rows, k, -1).sum(dim=1).to(x.dtype)
