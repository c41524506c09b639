"""The folder with the served model's tokenizer, for the gateways `kvgate up` starts: with it
they tokenise locally (no /tokenize round trip to a busy replica per request) and can give
prefix-stability advice. It resolves the model as the replicas will (a GGUF served as stored: its
config and tokenizer only), once, here, before the replicas start, instead of in every replica at
the same time."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def tokenizer_folder(model: str, quantization: str | None = None) -> str | None:
    """The model's local folder (with tokenizer.json) as replicas given `quantization` resolve
    it, or None when it cannot be resolved here (the gateways then tokenise through the replicas
    and say so in their logs)."""
    try:
        from backend_engine.errors import ModelLoadError
        from backend_engine.model_loader import resolve_model
        from backend_engine.quant.loader import served_quantization
    except ImportError as exc:  # a gateway-only install has no engine
        log.warning("cannot resolve %s's tokenizer here (%s)", model, exc)
        return None
    try:
        folder = resolve_model(model, served_quantization(model, quantization)[0]).folder
    except (ModelLoadError, OSError) as exc:
        log.warning("cannot resolve %s's tokenizer here (%s)", model, exc)
        return None
    return str(folder) if (folder / "tokenizer.json").is_file() else None
