"""AWQ and GPTQ checkpoints (Hugging Face layout) loaded as stored: packed 4-bit values, fp16
scales and packed integer zeros become `Int4Weight`s (min = -zero * scale), no requantisation.

AWQ (AutoAWQ "gemm"): `qweight` int32 [K, N/8] and `qzeros` int32 [K/g, N/8], eight values per
word along the output dimension in the interleaved order 0 2 4 6 1 3 5 7; `scales` [K/g, N].
GPTQ (AutoGPTQ/GPTQModel): `qweight` int32 [K/8, N], eight values per word along the input
dimension; `qzeros` int32 [K/g, N/8] in plain order, stored minus one in the original ("gptq",
v1) checkpoint format; `scales` [K/g, N]; `g_idx` [K], each input channel's group: with act-order
(desc_act) the groups are not contiguous, so the input channels are reordered (`perm`).
"""

from __future__ import annotations

import torch

from backend_engine.errors import ModelLoadError
from backend_engine.quant.formats import GROUP_SIZES, Int4Weight, pack_nibbles

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble index holding output column j of a word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def quant_method(hf_config) -> str | None:
    qc = _quant_config(hf_config)
    method = qc.get("quant_method") if qc else None
    return str(method).lower() if method else None


def _quant_config(hf_config) -> dict:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    return qc or {}


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C/8] → uint8 [R, C]: word c holds columns 8c..8c+7 (nibble i → column order[i]
    reversed, when an order is given)."""
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF  # [R, C/8, 8]
    if order is not None:
        nibbles = nibbles[..., list(order)]
    return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] → uint8 [R, C]: word r holds rows 8r..8r+7, low nibble first."""
    nibbles = (packed.to(torch.int32).unsqueeze(1) >> _SHIFTS[:, None]) & 0xF  # [R/8, 8, C]
    return nibbles.reshape(-1, packed.shape[1]).to(torch.uint8)


def convert_checkpoint(state: dict[str, torch.Tensor], hf_config,
                       method: str) -> dict[str, torch.Tensor | Int4Weight]:
    """Replace each quantised linear's parts with one Int4Weight under `<name>.weight`."""
    qc = _quant_config(hf_config)
    bits, group_size = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise ModelLoadError(f"--quantization {method}: only 4-bit checkpoints load, this one "
                             f"has bits={bits}")
    if group_size not in GROUP_SIZES:
        raise ModelLoadError(f"--quantization {method}: group_size {group_size} in "
                             f"quantization_config is not one of {GROUP_SIZES}")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ModelLoadError(f"AWQ version {qc.get('version')!r} is not supported; only 'gemm'")
    if method == "awq" and not qc.get("zero_point", True):
        raise ModelLoadError("AWQ checkpoints without zero points are not supported")
    bases = sorted(k[:-len(".qweight")] for k in state if k.endswith(".qweight"))
    if not bases:
        raise ModelLoadError(f"--quantization {method} needs a {method.upper()} checkpoint, but "
                             "this one has no packed (*.qweight) tensors")
    out = {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] not in _PARTS}
    v1_zeros = method == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq"
    for base in bases:
        parts = {p: state.get(f"{base}.{p}") for p in _PARTS}
        for p in ("qzeros", "scales"):
            if parts[p] is None:
                raise ModelLoadError(f"{base}.{p} missing from the {method.upper()} checkpoint")
        if method == "awq":
            out[f"{base}.weight"] = _awq(base, parts, group_size)
        else:
            out[f"{base}.weight"] = _gptq(base, parts, group_size, v1_zeros)
    return out


def _check_groups(base: str, scales: torch.Tensor, zeros: torch.Tensor, in_features: int,
                  out_features: int, group_size: int) -> None:
    want = in_features // group_size if in_features % group_size == 0 else None
    if want is None or scales.shape != (want, out_features) or zeros.shape[0] != want:
        raise ModelLoadError(
            f"{base}.scales has shape {tuple(scales.shape)}, but {in_features} input features "
            f"in groups of {group_size} (quantization_config group_size) need "
            f"{(in_features / group_size):g} x {out_features}: the group size does not match "
            "the tensors")


def _int4(q_t: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
          perm: torch.Tensor | None) -> Int4Weight:
    """q_t uint8 [N, K] (grouped order), zeros/scales [K/g, N] → w = (q - zero) * scale."""
    scales_t = scales.float().t().contiguous()
    mins = (-zeros.float().t() * scales_t).contiguous()
    return Int4Weight(pack_nibbles(q_t).contiguous(), scales_t, mins, group_size, perm)


def _awq(base: str, parts: dict, group_size: int) -> Int4Weight:
    q = unpack_cols(parts["qweight"], AWQ_REVERSE_ORDER)  # [K, N]
    zeros = unpack_cols(parts["qzeros"], AWQ_REVERSE_ORDER)  # [K/g, N]
    in_features, out_features = q.shape
    _check_groups(base, parts["scales"], zeros, in_features, out_features, group_size)
    return _int4(q.t().contiguous(), zeros, parts["scales"], group_size, None)


def _gptq(base: str, parts: dict, group_size: int, v1_zeros: bool) -> Int4Weight:
    q = unpack_rows(parts["qweight"])  # [K, N]
    zeros = unpack_cols(parts["qzeros"]).to(torch.int32) + (1 if v1_zeros else 0)
    in_features, out_features = q.shape
    zeros = zeros[:, :out_features]
    _check_groups(base, parts["scales"], zeros, in_features, out_features, group_size)
    perm = None
    g_idx = parts["g_idx"]
    if g_idx is not None:
        g_idx = g_idx.long()
        expected = torch.arange(in_features) // group_size
        if not torch.equal(g_idx, expected):  # act-order: make each group contiguous
            counts = torch.bincount(g_idx, minlength=in_features // group_size)
            if g_idx.shape != (in_features,) or counts.numel() != in_features // group_size \
                    or not bool((counts == group_size).all()):
                raise ModelLoadError(f"{base}.g_idx does not give every group {group_size} "
                                     "input channels")
            perm = torch.argsort(g_idx, stable=True)
            q = q[perm]
    return _int4(q.t().contiguous(), zeros, parts["scales"], group_size, perm)
