"""Which model class runs a checkpoint, from its config's `model_type`, and the config fields
each family refuses: a field the model code does not implement is an error naming it, never
silently ignored. Pure Python (no torch, no model code: the classes are imported by name when
asked for): the loader checks a config before it reads any weight.

| model_type     | class (file)                 | differs from the Llama decoder            |
|----------------|------------------------------|-------------------------------------------|
| llama, mistral | LlamaModel (models/llama.py) | —                                         |
| qwen2          | LlamaModel (models/llama.py) | q/k/v biases (read from the checkpoint)   |
| qwen3          | Qwen3Model (models/qwen3.py) | an RMSNorm over each q and k head         |
| phi3           | Phi3Model (models/phi3.py)   | q/k/v and gate/up fused in the checkpoint |
| gemma3_text    | Gemma3Model (models/gemma3.py) | 1 + w norms around attention and MLP, GeGLU, q/k norms, sliding-window layers, two rotary bases |
| mixtral        | MixtralModel (models/mixtral.py) | a top-k mixture of experts as every MLP (models/moe.py) |
| qwen3_moe      | Qwen3MoeModel (models/qwen3_moe.py) | Qwen3's q/k norms; a top-k mixture of experts as the MLP of the sparse layers |

Every family reads: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim, rms_norm_eps, vocab_size, max_position_embeddings, rope_theta /
rope_scaling (rotary.py), tie_word_embeddings, sliding_window (caps max_model_len where the
family has no sliding-window layers), eos ids. gemma3_text also reads layer_types,
sliding_window, query_pre_attn_scalar and rope_parameters per layer type. The MoE families
also read num_experts (mixtral: num_local_experts) and num_experts_per_tok; mixtral's experts
are intermediate_size wide; qwen3_moe reads moe_intermediate_size, norm_topk_prob,
decoder_sparse_step and mlp_only_layers (its dense layers are intermediate_size wide).
Training-only fields (router_aux_loss_coef, output_router_logits, mixtral's
router_jitter_noise, which only acts in training) do not change inference and are not read.
"""

from __future__ import annotations

import importlib
from typing import Any

from backend_engine.errors import ModelLoadError

FAMILIES: dict[str, str] = {  # model_type → "module:class" under backend_engine.models
    "llama": "llama:LlamaModel",
    "mistral": "llama:LlamaModel",
    "qwen2": "llama:LlamaModel",
    "qwen3": "qwen3:Qwen3Model",
    "phi3": "phi3:Phi3Model",
    "gemma3_text": "gemma3:Gemma3Model",
    "mixtral": "mixtral:MixtralModel",
    "qwen3_moe": "qwen3_moe:Qwen3MoeModel",
}
# families whose code runs sliding-window layers (the others are exact only inside the window)
SLIDING_WINDOW_LAYERS = ("gemma3_text",)

# (field, the values the model code implements): anything else is refused
_ACTIVATIONS = ("silu",)
# router kinds and shared experts other MoE families have (DeepSeek, Qwen2-MoE), refused where
# a config carries them: the MoE code runs a softmax top-k router and routed experts only
_MOE_ROUTER = (("scoring_func", ("softmax", None)), ("topk_method", ("greedy", None)),
               ("n_shared_experts", (0, None)), ("shared_expert_intermediate_size", (0, None)))
_REFUSED: dict[str, tuple[tuple[str, Any], ...]] = {
    "llama": (("hidden_act", _ACTIVATIONS), ("mlp_bias", (False, None)),
              ("attention_bias", (False, None))),  # True: an o_proj bias too
    "mistral": (("hidden_act", _ACTIVATIONS),),
    "qwen2": (("hidden_act", _ACTIVATIONS), ("use_sliding_window", (False, None))),
    "qwen3": (("hidden_act", _ACTIVATIONS), ("use_sliding_window", (False, None)),
              ("attention_bias", (False, None))),  # True: an o_proj bias too
    "phi3": (("hidden_act", _ACTIVATIONS),
             ("partial_rotary_factor", (1.0, None))),  # Phi-4-mini rotates 3/4 of each head
    "gemma3_text": (("hidden_activation", ("gelu_pytorch_tanh",)),
                    ("attention_bias", (False, None)), ("attn_logit_softcapping", (None,)),
                    ("final_logit_softcapping", (None,)),
                    ("use_bidirectional_attention", (False, None))),
    "mixtral": (("hidden_act", _ACTIVATIONS), *_MOE_ROUTER),
    "qwen3_moe": (("hidden_act", _ACTIVATIONS), ("use_sliding_window", (False, None)),
                  ("attention_bias", (False, None)), *_MOE_ROUTER),
}


def check_config(config) -> None:
    """Refuse an architecture, or a config field value, the model code does not implement."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ModelLoadError(f"unsupported architecture {model_type!r}; supported: "
                             + ", ".join(sorted(FAMILIES)))
    for name, allowed in _REFUSED[model_type]:
        value = getattr(config, name, None)
        if value is None:  # newer transformers keep rotary settings in rope_parameters
            value = (getattr(config, "rope_parameters", None) or {}).get(name)
        if value not in allowed:
            raise ModelLoadError(
                f"{model_type} config field {name}={value!r} is not implemented (supported: "
                + ", ".join(repr(a) for a in allowed if a is not None) + ")")


def context_limit(config) -> int:
    """The longest context the family's code answers exactly: a family without sliding-window
    layers runs full attention, which equals a sliding-window config's only inside the window."""
    limit = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "model_type", None) not in SLIDING_WINDOW_LAYERS:
        limit = min(limit, window)
    return limit


def model_class(config) -> type:
    """The class that runs this config's family (check_config first)."""
    check_config(config)
    module, name = FAMILIES[config.model_type].split(":")
    return getattr(importlib.import_module(f"backend_engine.models.{module}"), name)
