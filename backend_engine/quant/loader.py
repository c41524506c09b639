"""Which quantisation applies to a checkpoint, and its weights loaded in that form.

`--quantization` has vLLM's meaning: unset follows the checkpoint (AWQ/GPTQ as stored, else
unquantised); int8/int4 quantise an fp checkpoint at load, or read a GGUF's tensors into the
nearest format; awq/gptq need such a checkpoint. A flag that does not fit the checkpoint is an
error that names the flag, raised before any weight is read.
"""

from __future__ import annotations

from pathlib import Path

from backend_engine.errors import ModelLoadError
from backend_engine.quant.awq_gptq import convert_checkpoint, quant_method
from backend_engine.quant.gguf import stored_format

METHODS = ("none", "int8", "int4", "awq", "gptq")


def resolve_quantization(flag: str | None, hf_config, folder: Path) -> str | None:
    """The method the model in `folder` loads with (None: unquantised)."""
    from backend_engine.model_loader import gguf_source

    from_gguf = gguf_source(folder) is not None
    if flag is not None and flag not in METHODS:
        raise ModelLoadError(f"--quantization {flag!r} is not one of {', '.join(METHODS)}")
    stored = None if from_gguf else quant_method(hf_config)
    if stored is not None and stored not in ("awq", "gptq"):
        raise ModelLoadError(f"the checkpoint's quantization_config names {stored!r}; kvgate "
                             "loads awq and gptq checkpoints")
    if flag is None:
        return stored
    if stored is not None and flag != stored:
        raise ModelLoadError(f"--quantization {flag} does not fit this checkpoint, which is "
                             f"{stored}-quantised: use --quantization {stored} (or leave it unset)")
    if flag in ("awq", "gptq") and stored is None:
        kind = "GGUF" if from_gguf else "unquantised (fp)"
        raise ModelLoadError(f"--quantization {flag} needs a checkpoint whose config.json "
                             f"quantization_config.quant_method is '{flag}'; this one is {kind}: "
                             "use --quantization int4 or int8 to quantise it at load")
    return None if flag == "none" else flag


def served_quantization(spec: str, quantization: str | None) -> tuple[str | None, str]:
    """The quantisation a model is served with: `quantization` as given, or, for a GGUF file
    without one, its stored format's nearest (as llama.cpp serves it; `none` dequantises);
    and a line for the start-up log saying which."""
    from backend_engine.model_loader import gguf_file

    gguf = gguf_file(spec) if quantization is None else None
    if gguf is None:
        return quantization, f"quantization {quantization or 'none'}"
    method, types = stored_format(gguf)
    return method, (f"{gguf.name} served as stored ({types}: {method or 'float'} weights; "
                    "--quantization none dequantises it)")


def load_weights(folder: Path, hf_config, method: str | None) -> dict:
    """Every tensor of the checkpoint under its HF name; linear weights may be quantised."""
    from backend_engine.model_loader import gguf_source, load_state_dict

    gguf = gguf_source(folder)
    if gguf is not None:
        if method not in ("int4", "int8"):
            raise ModelLoadError(f"{folder} holds no weights of its own (they are read from "
                                 f"{gguf.name}), which needs --quantization int4 or int8")
        from backend_engine.quant.gguf import load_gguf_weights

        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        return load_gguf_weights(gguf, method, heads, kv_heads)
    state = load_state_dict(folder)
    if method in ("awq", "gptq"):
        return convert_checkpoint(state, hf_config, method)
    return state
