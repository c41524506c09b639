"""Rotary position embedding (RoPE) with the scaling variants Llama-family configs use."""

from __future__ import annotations

import torch

from backend_engine.errors import ModelLoadError

STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The rotary settings; `layer_type` picks a family's per-layer-type ones (Gemma 3 keeps
    one base for its sliding-window layers and another for its global ones)."""
    params = getattr(config, "rope_parameters", None)
    if params and layer_type is not None:
        if layer_type not in params:
            raise ModelLoadError(f"rope_parameters has no entry for {layer_type!r} layers")
        return dict(params[layer_type])
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def inverse_frequencies(config, head_dim: int, layer_type: str | None = None
                        ) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope_type {rope_type!r}")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        return (1.0 / (params["rope_theta"] ** exponents)).float(), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, attention_scaling = (init(config, torch.device("cpu")) if layer_type is None
                                   else init(config, torch.device("cpu"), layer_type=layer_type))
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding:
    """Precomputed cos/sin for every position up to max_positions (HF's half-split layout)."""

    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", layer_types: tuple[str, ...] = ()):
        """layer_types: a family's kinds of layer with rotary settings of their own; each
        row's cos/sin then hold one per kind, side by side ([T, kinds, 1, D]; a layer takes
        `cos[:, kind]`)."""
        if layer_types:
            tables = [_cos_sin_table(config, head_dim, max_positions, t) for t in layer_types]
            cos, sin = (torch.stack(ts, dim=1) for ts in zip(*tables))  # [P, kinds, D]
        else:
            cos, sin = _cos_sin_table(config, head_dim, max_positions, None)  # [P, D]
        self.cos = cos.to(dtype=dtype, device=device)
        self.sin = sin.to(dtype=dtype, device=device)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, H, D], k [T, KVH, D] → rotated copies."""
        cos, sin = self.cos_sin(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] each ([T, kinds, 1, D] with layer_types): looked up once per step,
        shared by every layer."""
        return self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (q and k heads side by side rotate in one pass) → a rotated copy."""
        return _rotate(x, cos, sin)


def _cos_sin_table(config, head_dim: int, max_positions: int, layer_type: str | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq, scaling = inverse_frequencies(config, head_dim, layer_type)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
