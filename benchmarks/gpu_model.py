"""The model the GPU check runs: the default model where its GGUF is installed, else the default
model's exact shape (its config and tokenizer, carried in KVGATE_DEFAULT_MODEL_META) with seeded
random weights, written once to the cache. Speed figures hold for either; token parity between
devices is checked on whichever it is."""

from __future__ import annotations

import importlib.util

from backend_engine.model_loader import (DEFAULT_MODEL_PACKAGE, default_meta_folder,
                                         write_random_model)
from backend_engine.process_env import cache_root


def check_model(random_weights: bool = False) -> str:
    """A model argument for LLM(): "default", or the random-weights folder of its shape."""
    if not random_weights and importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is not None:
        return "default"
    from transformers import AutoConfig, AutoTokenizer

    meta = default_meta_folder()
    target = cache_root() / "models" / "random-default-shape"
    if not (target / "config.json").is_file():
        write_random_model(AutoConfig.from_pretrained(meta), AutoTokenizer.from_pretrained(meta),
                           target)
    return str(target)


if __name__ == "__main__":
    print(check_model())
