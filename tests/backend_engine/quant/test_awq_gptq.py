"""AWQ and GPTQ checkpoints load as stored: the model computes with exactly the values the
checkpoint holds (compared with an fp checkpoint of those values), and bad ones are refused."""

import pytest
import torch

from backend_engine.errors import ModelLoadError
from backend_engine.llm import LLM
from backend_engine.model_loader import load_state_dict
from backend_engine.quant.awq_gptq import convert_checkpoint
from backend_engine.quant.formats import Int4Weight
from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.helpers import assert_no_leaks
from tests.backend_engine.quant.checkpoints import write_checkpoints

CASES = [("awq", 32, False), ("gptq", 64, False), ("gptq", 32, True)]


def _config(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


@pytest.mark.parametrize("method,group_size,act_order", CASES)
def test_unpacked_weights_equal_the_checkpoint_values(tmp_path, method, group_size, act_order):
    quantised, reference = write_checkpoints(tmp_path, method, group_size, act_order)
    weights = convert_checkpoint(load_state_dict(quantised), _config(quantised), method)
    ref = load_state_dict(reference)
    for name, w in ref.items():
        if isinstance(weights[name], Int4Weight):
            assert weights[name].group_size == group_size
            assert (weights[name].perm is not None) == act_order
            torch.testing.assert_close(weights[name].dequantize(), w, atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(weights[name], w), name
    assert not any(k.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for k in weights)


@pytest.mark.parametrize("method,group_size,act_order", CASES)
def test_engine_serves_the_checkpoint_like_its_fp_values(tmp_path, method, group_size, act_order):
    quantised, reference = write_checkpoints(tmp_path, method, group_size, act_order)
    llm = LLM(str(quantised), enforce_eager=True, num_kv_blocks=64)  # the method comes from quantization_config
    fp = LLM(str(reference), enforce_eager=True, num_kv_blocks=64)
    assert isinstance(llm.engine.runner.model.layers[0].qkv_weight.perm, torch.Tensor) == act_order
    model, ref_model = llm.engine.runner.model, fp.engine.runner.model
    ids = torch.tensor(llm.tokenizer.encode("The quick brown fox jumps over the lazy dog"))
    logits = _prompt_logits(model, ids)
    ref = _prompt_logits(ref_model, ids)
    # AWQ/GPTQ store it unquantised: int8 per channel, in the plan's lm_head form
    assert model.lm_head.kind == f"{llm.engine.runner.forward_pass.plan.lm_head}_cpu"
    # bf16 activations in the int4 kernel and int8 ones in the lm_head: close, not bit-equal
    assert (logits - ref).abs().max() <= 0.05 * ref.abs().max()
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8
    assert_no_leaks(llm.engine)


def _prompt_logits(model, ids):
    from backend_engine.attention.metadata import AttentionMetadata, PrefillChunk

    n = len(ids)
    shape = (-(-n // 16), 16, model.num_kv_heads, model.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    slots = torch.arange(n)
    meta = AttentionMetadata(slot_mapping=slots,
                             prefills=[PrefillChunk(0, n, n, torch.arange(shape[0]))])
    return model.compute_logits(model.forward(ids, torch.arange(n), caches, meta))


def test_a_group_size_that_does_not_match_the_tensors_names_the_tensor(tmp_path):
    quantised, _ = write_checkpoints(tmp_path, "awq", 32, stated_group_size=64)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\..*\.scales has shape .*groups of 64"):
        LLM(str(quantised), enforce_eager=True, quantization="awq", num_kv_blocks=16)


def test_awq_flag_on_an_fp_checkpoint_names_the_flag(tmp_path):
    _, reference = write_checkpoints(tmp_path, "awq", 32)
    with pytest.raises(ModelLoadError, match=r"--quantization awq needs a checkpoint.*'awq'.*fp"):
        LLM(str(reference), enforce_eager=True, quantization="awq", num_kv_blocks=16)


def test_a_flag_that_contradicts_the_checkpoint_names_both(tmp_path):
    quantised, _ = write_checkpoints(tmp_path, "gptq", 32)
    with pytest.raises(ModelLoadError, match=r"--quantization int4 .* gptq-quantised"):
        LLM(str(quantised), enforce_eager=True, quantization="int4", num_kv_blocks=16)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("lm_head", ["w8a8", "int8", "int4"])
def test_a_quantised_lm_head_takes_the_asked_format(quantization, lm_head):
    llm = LLM("tiny-random", enforce_eager=True, quantization=quantization, num_kv_blocks=16,
              engine_options={"lm_head": lm_head})
    model = llm.engine.runner.model
    assert model.layers[0].qkv_weight.kind == f"{quantization}_cpu"
    assert model.lm_head.kind == f"{lm_head}_cpu"
    fp = model.embed.float()  # tied: the lm_head is the embedding, quantised
    torch.testing.assert_close(model.lm_head.dequantize(), fp, atol=fp.abs().max() / 7, rtol=0)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert_no_leaks(llm.engine)


def test_an_unknown_lm_head_format_is_refused():
    with pytest.raises(ValueError, match="lm_head"):
        LLM("tiny-random", enforce_eager=True, quantization="int4",
            engine_options={"lm_head": "int2"})
