"""The folder with the served model's tokenizer, for the gateways `kvgate up` starts: with it
they tokenise locally (no /tokenize round trip to a busy replica per request) and can give
prefix-stability advice. Resolving the default model also converts its GGUF once, here, before
the replicas start, instead of in every replica at the same time."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def tokenizer_folder(model: str) -> str | None:
    """The model's local folder (with tokenizer.json), or None when it cannot be resolved here
    (the gateways then tokenise through the replicas and say so in their logs)."""
    try:
        from backend_engine.errors import ModelLoadError
        from backend_engine.model_loader import resolve_model
    except ImportError as exc:  # a gateway-only install has no engine
        log.warning("cannot resolve %s's tokenizer here (%s)", model, exc)
        return None
    try:
        folder = resolve_model(model).folder
    except (ModelLoadError, OSError) as exc:
        log.warning("cannot resolve %s's tokenizer here (%s)", model, exc)
        return None
    return str(folder) if (folder / "tokenizer.json").is_file() else None
