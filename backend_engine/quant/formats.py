"""Quantised linear weights in their canonical, device-independent layout.

A linear weight W [out_features N, in_features K] is kept as
- `Int8Weight`: int8 values and one scale per output channel, W = q * scale[:, None];
- `Int4Weight`: 4-bit values in groups of `group_size` input channels with a scale and a min
  per group (asymmetric), W = q * scale + min with q in 0..15, two values a byte, low nibble
  first. `perm`, when set, is the input-channel order under which the groups are contiguous
  (GPTQ act-order): W[:, perm] is the grouped matrix.

Every format is row-wise, so weights concatenate along output rows (q/k/v fusion) and narrow to a
slice of rows or of whole groups (tensor-parallel shards) before `prepare` turns them into a
kernel's layout for a device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from backend_engine.errors import ModelLoadError

GROUP_SIZES = (32, 64, 128)

log = logging.getLogger(__name__)


class QuantFormatError(ModelLoadError, ValueError):
    """A weight cannot take the requested quantised form."""


@dataclass(slots=True, eq=False)
class Int8Weight:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)


@dataclass(slots=True, eq=False)
class Int4Weight:
    qweight: torch.Tensor  # uint8 [N, K // 2], low nibble = even input channel
    scales: torch.Tensor  # float32 [N, K // group_size]
    mins: torch.Tensor  # float32 [N, K // group_size]
    group_size: int
    perm: torch.Tensor | None = None  # long [K]; None: groups are contiguous in input order

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    @property
    def nbytes(self) -> int:
        extra = self.perm.nbytes if self.perm is not None else 0
        return self.qweight.nbytes + self.scales.nbytes + self.mins.nbytes + extra

    def values(self) -> torch.Tensor:
        """The 4-bit values as uint8 [N, K] in grouped (permuted) order."""
        return unpack_nibbles(self.qweight)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        g = self.group_size
        q = self.values().float().view(n, k // g, g)
        grouped = (q * self.scales.float()[..., None] + self.mins.float()[..., None]).view(n, k)
        if self.perm is None:
            return grouped.to(dtype)
        w = torch.empty_like(grouped)
        w[:, self.perm] = grouped
        return w.to(dtype)


LinearWeight = torch.Tensor | Int8Weight | Int4Weight


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of values 0..15 → uint8 [N, K // 2], low nibble first."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric, per output channel."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.contiguous())


CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def quantize_int4(w: torch.Tensor, group_size: int, name: str = "weight") -> Int4Weight:
    """Asymmetric per group of `group_size` input channels; each group's range is the min/max
    shrunk by whichever of CLIP_RATIOS gives the least squared error (outliers otherwise
    stretch the 16 levels over values that barely occur)."""
    n, k = w.shape
    check_group_size(group_size, k, name)
    groups = w.float().reshape(n, k // group_size, group_size)
    lo0, hi0 = groups.amin(dim=-1), groups.amax(dim=-1)
    best = None
    for ratio in CLIP_RATIOS:
        lo, hi = lo0 * ratio, hi0 * ratio
        scales = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((groups - lo[..., None]) / scales[..., None]).clamp(0, 15)
        err = ((q * scales[..., None] + lo[..., None] - groups) ** 2).sum(-1)
        if best is None:
            best = (err, q, scales, lo)
            continue
        better = err < best[0]
        best = (torch.where(better, err, best[0]), torch.where(better[..., None], q, best[1]),
                torch.where(better, scales, best[2]), torch.where(better, lo, best[3]))
    _, q, scales, lo = best
    return Int4Weight(pack_nibbles(q.view(n, k)).contiguous(), scales.contiguous(),
                      lo.contiguous(), group_size)


def check_group_size(group_size: int, in_features: int, name: str) -> None:
    if group_size not in GROUP_SIZES:
        raise QuantFormatError(f"group size {group_size} is not one of {GROUP_SIZES}")
    if in_features % group_size:
        fits = [g for g in GROUP_SIZES if in_features % g == 0]
        raise QuantFormatError(
            f"int4 group size {group_size} (--quantization-group-size) does not divide the "
            f"{in_features} input features of {name}; sizes that do: {fits or 'none'}")


def is_quantized(w: LinearWeight) -> bool:
    return isinstance(w, (Int8Weight, Int4Weight))


def _same_int4_layout(ws: list[Int4Weight]) -> bool:
    first = ws[0]
    for w in ws[1:]:
        if w.group_size != first.group_size or (w.perm is None) != (first.perm is None):
            return False
        if w.perm is not None and not torch.equal(w.perm, first.perm):
            return False
    return True


def cat_rows(weights: list[LinearWeight]) -> LinearWeight:
    """Stack weights that share in_features along the output dimension (one fused matmul).
    Mixed formats (e.g. a GGUF with Q4_K q/k and a Q6_K v) meet in int8 per channel, the
    format every other one converts to with the least loss."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.cat(weights).contiguous()
    if all(isinstance(w, Int4Weight) for w in weights) and _same_int4_layout(weights):
        return Int4Weight(torch.cat([w.qweight for w in weights]),
                          torch.cat([w.scales for w in weights]),
                          torch.cat([w.mins for w in weights]), weights[0].group_size,
                          weights[0].perm)
    if not all(isinstance(w, Int8Weight) for w in weights):
        log.info("fusing weights of formats %s in int8", [type(w).__name__ for w in weights])
        weights = [to_int8(w) for w in weights]
    return Int8Weight(torch.cat([w.qweight for w in weights]),
                      torch.cat([w.scales for w in weights]))


def to_int8(w: LinearWeight) -> Int8Weight:
    if isinstance(w, Int8Weight):
        return w
    return quantize_int8(w.dequantize() if isinstance(w, Int4Weight) else w)


def narrow(w: LinearWeight, dim: int, start: int, length: int) -> LinearWeight:
    """A slice of output rows (dim 0) or input columns (dim 1) — a tensor-parallel shard.
    Int4 column slices must cover whole groups."""
    if isinstance(w, torch.Tensor):
        return w.narrow(dim, start, length).contiguous()
    if isinstance(w, Int8Weight):
        if dim == 0:
            return Int8Weight(w.qweight[start:start + length].contiguous(),
                              w.scales[start:start + length].contiguous())
        return Int8Weight(w.qweight[:, start:start + length].contiguous(), w.scales)
    if dim == 0:
        rows = slice(start, start + length)
        return Int4Weight(w.qweight[rows].contiguous(), w.scales[rows].contiguous(),
                          w.mins[rows].contiguous(), w.group_size, w.perm)
    g = w.group_size
    if start % g or length % g or w.perm is not None:
        raise QuantFormatError(f"an int4 column slice must cover whole groups of {g} input "
                               "features in input order")
    cols, groups = slice(start // 2, (start + length) // 2), slice(start // g, (start + length) // g)
    return Int4Weight(w.qweight[:, cols].contiguous(), w.scales[:, groups].contiguous(),
                      w.mins[:, groups].contiguous(), g)
