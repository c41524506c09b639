"""Tiny AWQ and GPTQ checkpoints made from the tiny random model, packed the way AutoAWQ and
AutoGPTQ pack, plus the fp checkpoint of exactly the values they hold (the reference)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from backend_engine.model_loader import load_state_dict, resolve_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column held by nibble i of a word


def zero_point_quantize(w: torch.Tensor, group_size: int):
    """w [N, K] → q [N, K], integer zeros [N, K/g], fp16 scales [N, K/g]: w ≈ (q - z) * s."""
    n, k = w.shape
    groups = w.view(n, k // group_size, group_size)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-5).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    q = torch.round(groups / scales.float()[..., None] + zeros[..., None]).clamp(0, 15)
    return q.view(n, k).int(), zeros.int(), scales


def dequantize(q, zeros, scales, group_size) -> torch.Tensor:
    n, k = q.shape
    g = q.view(n, k // group_size, group_size).float()
    return ((g - zeros[..., None].float()) * scales.float()[..., None]).view(n, k)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_along_cols(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, C] → int32 [R, C/8]: nibble i of word c holds column 8c + order[i]."""
    v = values.long().view(values.shape[0], -1, 8)
    return _to_int32(sum(v[..., order[i]] << (4 * i) for i in range(8)))


def pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] → int32 [R/8, C]: nibble i of word r holds row 8r + i."""
    v = values.long().view(-1, 8, values.shape[1])
    return _to_int32(sum(v[:, i] << (4 * i) for i in range(8)))


def _base_folder() -> Path:
    return resolve_model("tiny-random").folder


def _write(folder: Path, state: dict, quantization_config: dict | None) -> Path:
    folder.mkdir(parents=True)
    for f in _base_folder().iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    config = json.loads((folder / "config.json").read_text())
    if quantization_config:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def write_checkpoints(root: Path, method: str, group_size: int, act_order: bool = False,
                      stated_group_size: int | None = None) -> tuple[Path, Path]:
    """(quantised checkpoint, fp checkpoint of its exact values)."""
    state = load_state_dict(_base_folder())
    quantised, reference = {}, {}
    gen = torch.Generator().manual_seed(0)
    perms: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        module = name.rsplit(".", 2)
        if len(module) < 3 or module[1] not in LINEARS or module[2] != "weight":
            quantised[name] = reference[name] = w
            continue
        base = name[:-len(".weight")]
        n, k = w.shape
        q, zeros, scales = zero_point_quantize(w, group_size)
        reference[name] = dequantize(q, zeros, scales, group_size)
        q_kn, zeros_gn, scales_gn = q.t().contiguous(), zeros.t().contiguous(), scales.t().contiguous()
        if method == "awq":
            quantised[base + ".qweight"] = pack_along_cols(q_kn, AWQ_ORDER)
            quantised[base + ".qzeros"] = pack_along_cols(zeros_gn, AWQ_ORDER)
        else:
            g_idx = torch.arange(k) // group_size
            if act_order:  # one input order per layer input, as GPTQ derives it from the inputs
                shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                          "up_proj": "gate_up"}
                key = module[0].rsplit(".", 1)[0] + shared.get(module[1], module[1])
                perm = perms.setdefault(key, torch.randperm(k, generator=gen))
                g_idx = torch.empty(k, dtype=torch.long)
                g_idx[perm] = torch.arange(k) // group_size
                # stored rows in input order: input channel perm[j] holds grouped column j
                q_in = torch.empty_like(q_kn)
                q_in[perm] = q_kn
                q_kn = q_in
                reference[name] = torch.empty_like(reference[name])
                reference[name][:, perm] = dequantize(q, zeros, scales, group_size)
            quantised[base + ".qweight"] = pack_along_rows(q_kn)
            quantised[base + ".qzeros"] = pack_along_cols(zeros_gn - 1)  # v1: stored minus one
            quantised[base + ".g_idx"] = g_idx.int()
        quantised[base + ".scales"] = scales_gn
    qc = {"quant_method": method, "bits": 4, "group_size": stated_group_size or group_size}
    qc.update({"version": "gemm", "zero_point": True} if method == "awq" else
              {"desc_act": act_order, "sym": False, "checkpoint_format": "gptq"})
    return (_write(root / method, quantised, qc), _write(root / f"{method}-reference", reference, None))
