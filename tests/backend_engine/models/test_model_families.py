"""A checkpoint's family is found from its config's model_type, and a config value the model
code does not implement is refused at load, naming the field, before any weight is read."""

import json

import pytest
from transformers import AutoConfig

from backend_engine.errors import ModelLoadError
from backend_engine.llm import LLM
from backend_engine.model_loader import resolve_model
from backend_engine.models.llama import LlamaModel
from backend_engine.models.phi3 import Phi3Model
from backend_engine.models.qwen3 import Qwen3Model
from backend_engine.model_families import check_config, context_limit, model_class
from backend_engine.models.gemma3 import Gemma3Model
from backend_engine.models.mixtral import MixtralModel
from backend_engine.models.qwen3_moe import Qwen3MoeModel


@pytest.mark.parametrize("family, cls", [("llama", LlamaModel), ("qwen2", LlamaModel),
                                         ("mistral", LlamaModel), ("qwen3", Qwen3Model),
                                         ("phi3", Phi3Model), ("gemma3", Gemma3Model),
                                         ("qwen3_moe", Qwen3MoeModel),
                                         ("mixtral", MixtralModel)])
def test_each_family_has_its_class(family, cls):
    config = AutoConfig.from_pretrained(resolve_model(f"tiny-random-{family}").folder)
    assert model_class(config) is cls


@pytest.mark.parametrize("model_type, field, value", [
    ("llama", "hidden_act", "gelu"), ("llama", "mlp_bias", True),
    ("llama", "attention_bias", True), ("qwen2", "use_sliding_window", True),
    ("qwen3", "use_sliding_window", True), ("qwen3", "attention_bias", True),
    ("phi3", "partial_rotary_factor", 0.75),
    ("gemma3_text", "final_logit_softcapping", 30.0),
    ("gemma3_text", "attn_logit_softcapping", 50.0),
    ("gemma3_text", "hidden_activation", "silu"),
    ("gemma3_text", "use_bidirectional_attention", True),
    # MoE routers and shared experts of other families (DeepSeek, Qwen2-MoE)
    ("mixtral", "scoring_func", "sigmoid"), ("mixtral", "n_shared_experts", 2),
    ("mixtral", "hidden_act", "gelu"), ("qwen3_moe", "topk_method", "group_limited_greedy"),
    ("qwen3_moe", "shared_expert_intermediate_size", 128), ("qwen3_moe", "attention_bias", True),
    ("qwen3_moe", "use_sliding_window", True),
])
def test_an_unimplemented_config_value_is_refused_naming_the_field(model_type, field, value):
    config = AutoConfig.for_model(model_type, **{field: value})
    with pytest.raises(ModelLoadError, match=f"{model_type} config field {field}="):
        check_config(config)


def test_only_a_family_without_sliding_window_layers_is_capped_at_its_window():
    assert context_limit(AutoConfig.for_model("mistral", sliding_window=512,
                                              max_position_embeddings=4096)) == 512
    assert context_limit(AutoConfig.for_model("gemma3_text", sliding_window=512,
                                              max_position_embeddings=4096)) == 4096


def edited_config(tmp_path, model: str, **fields) -> str:
    """A copy of a tiny model's folder whose config.json has `fields` set."""
    folder = resolve_model(model).folder
    for f in folder.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    return str(tmp_path)


def test_a_checkpoint_with_an_unimplemented_field_loads_nothing(tmp_path):
    folder = edited_config(tmp_path, "tiny-random-qwen3", use_sliding_window=True)
    with pytest.raises(ModelLoadError, match="use_sliding_window=True is not implemented"):
        LLM(folder, enforce_eager=True)


def edited_checkpoint(tmp_path, model: str, edit) -> str:
    """A copy of a tiny model's folder whose state dict `edit` changed in place."""
    from safetensors.torch import load_file, save_file

    folder = resolve_model(model).folder
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).symlink_to(f)
    [weights_file] = folder.glob("*.safetensors")
    state = load_file(weights_file)
    edit(state)
    save_file(state, tmp_path / weights_file.name)
    return str(tmp_path)


def test_missing_head_norms_are_named(tmp_path):
    name = "model.layers.1.self_attn.k_norm.weight"
    folder = edited_checkpoint(tmp_path, "tiny-random-qwen3", lambda state: state.pop(name))
    with pytest.raises(ModelLoadError, match=f"{name} missing"):
        LLM(folder, enforce_eager=True)


def test_a_fused_weight_of_the_wrong_size_is_named(tmp_path):
    name = "model.layers.0.self_attn.qkv_proj.weight"

    def cut(state):
        state[name] = state[name][:-8].contiguous()

    folder = edited_checkpoint(tmp_path, "tiny-random-phi3", cut)
    with pytest.raises(ModelLoadError, match=f"{name} has 120 rows"):
        LLM(folder, enforce_eager=True)


@pytest.mark.parametrize("model, name", [
    ("tiny-random-qwen3_moe", "model.layers.2.mlp.experts.down_proj"),
    ("tiny-random-mixtral", "model.layers.0.mlp.gate.weight"),  # the router
])
def test_a_missing_expert_weight_is_named(tmp_path, model, name):
    folder = edited_checkpoint(tmp_path, model, lambda state: state.pop(name))
    with pytest.raises(ModelLoadError, match=f"expert weight {name} missing"):
        LLM(folder, enforce_eager=True)


def test_an_expert_weight_of_the_wrong_shape_is_named(tmp_path):
    name = "model.layers.1.mlp.experts.gate_up_proj"

    def cut(state):
        state[name] = state[name][:, :-1].contiguous()

    folder = edited_checkpoint(tmp_path, "tiny-random-mixtral", cut)
    with pytest.raises(ModelLoadError, match=rf"expert weight {name} has shape \(4, 127, 64\); "
                                             rf"the config asks for \(4, 128, 64\)"):
        LLM(folder, enforce_eager=True)


def per_expert(state, block: str, names: tuple[str, str, str]) -> None:
    """Stacked experts → one tensor per expert, as save_pretrained and published checkpoints
    store them (mixtral: block_sparse_moe.experts.N.w1/w3/w2 and block_sparse_moe.gate)."""
    for key in [k for k in state if k.endswith("mlp.experts.gate_up_proj")]:
        layer = key.removesuffix("mlp.experts.gate_up_proj")
        gate_up, down = state.pop(key), state.pop(layer + "mlp.experts.down_proj")
        state[f"{layer}{block}.gate.weight"] = state.pop(layer + "mlp.gate.weight")
        inter = down.shape[2]
        for e in range(gate_up.shape[0]):
            parts = (gate_up[e, :inter], gate_up[e, inter:], down[e])
            for stored, part in zip(names, parts):
                state[f"{layer}{block}.experts.{e}.{stored}.weight"] = part.contiguous()


@pytest.mark.parametrize("model, block, names", [
    ("tiny-random-mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
    ("tiny-random-qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
])
def test_per_expert_checkpoints_answer_as_stacked_ones(tmp_path, model, block, names):
    from backend_engine.sampling_params import SamplingParams

    folder = edited_checkpoint(tmp_path, model, lambda state: per_expert(state, block, names))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 900, 3000, 77, 12], list(range(100, 140))]
    answers = [[o.outputs[0].token_ids for o in LLM(m, enforce_eager=True, num_kv_blocks=32,
                                                    dtype="float32").generate(prompts, params)]
               for m in (folder, model)]
    assert answers[0] == answers[1]


def test_a_missing_per_expert_weight_is_named(tmp_path):
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"

    def edit(state):
        per_expert(state, "block_sparse_moe", ("w1", "w3", "w2"))
        state.pop(name)

    folder = edited_checkpoint(tmp_path, "tiny-random-mixtral", edit)
    with pytest.raises(ModelLoadError, match=f"expert weight {name} missing"):
        LLM(folder, enforce_eager=True)


def test_more_experts_per_token_than_experts_is_refused(tmp_path):
    folder = edited_config(tmp_path, "tiny-random-mixtral", num_experts_per_tok=5)
    with pytest.raises(ModelLoadError, match="num_experts_per_tok=5 must be between 1 and "
                                             "num_experts=4"):
        LLM(folder, enforce_eager=True)
