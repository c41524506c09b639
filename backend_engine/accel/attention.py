"""The attention backend the plan names: torch (any device; the reference) or Triton (CUDA)."""

from __future__ import annotations

from backend_engine.attention.backend import AttentionBackend
from backend_engine.attention.torch_backend import TorchAttention


class AttentionBackendUnavailableError(RuntimeError):
    """The requested backend cannot run here (e.g. triton is not installed)."""


def get_attention_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """"torch" (any device; the reference) or "triton" (CUDA), as the plan names it."""
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        try:  # triton is optional (kvgate[gpu]): imported only where the plan picks it
            from backend_engine.accel.cuda.attention import TritonAttention
        except ImportError as exc:
            raise AttentionBackendUnavailableError(
                "the triton attention backend needs the triton package: pip install "
                f"'kvgate[gpu]', or --engine-option attention=torch ({exc})") from exc
        return TritonAttention(device)
    raise ValueError(f"unknown attention backend {name!r}; choose torch or triton")
