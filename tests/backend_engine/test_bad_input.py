"""Bad input gets a clear error and loses nothing; the engine keeps serving."""

import pytest

from backend_engine.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError
from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.helpers import assert_no_leaks

OK = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _still_serves(llm):
    out = llm.generate("Hello there", OK)
    assert len(out[0].outputs[0].token_ids) == 4
    assert_no_leaks(llm.engine)


def test_empty_prompt_is_rejected(tiny_llm):
    with pytest.raises(InvalidRequestError, match="empty") as err:
        tiny_llm.generate([[]], OK)
    assert err.value.param == "prompt"
    _still_serves(tiny_llm)


def test_prompt_over_the_context_is_rejected(tiny_llm):
    too_long = [5] * (tiny_llm.engine.max_model_len + 1)
    with pytest.raises(ContextLengthExceededError, match="maximum context length") as err:
        tiny_llm.generate([too_long], OK)
    assert err.value.code == "context_length_exceeded"
    _still_serves(tiny_llm)


def test_prompt_plus_max_tokens_over_the_context_is_rejected(tiny_llm):
    prompt = [5] * (tiny_llm.engine.max_model_len - 2)
    with pytest.raises(ContextLengthExceededError):
        tiny_llm.generate([prompt], SamplingParams(max_tokens=10))
    _still_serves(tiny_llm)


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("max_tokens", -3), ("n", 0),
                                         ("n", 1000), ("temperature", -1.0), ("top_p", 0.0),
                                         ("logprobs", 21), ("min_tokens", 99)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_out_of_vocabulary_token_ids_are_rejected(tiny_llm):
    with pytest.raises(InvalidRequestError, match="token ids"):
        tiny_llm.generate([[1, 2, 10**9]], OK)
    _still_serves(tiny_llm)


def test_a_bad_request_in_a_batch_adds_none_of_the_batch(tiny_llm):
    with pytest.raises(InvalidRequestError):
        tiny_llm.generate([[1, 2, 3], []], OK)
    assert not tiny_llm.engine.has_unfinished_requests()
    _still_serves(tiny_llm)


@pytest.mark.parametrize("spec", ["/nonexistent/model", "tiny-random-gpt9"])
def test_unknown_model_is_a_clear_error(spec):
    with pytest.raises(ModelLoadError):
        LLM(spec, enforce_eager=True)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2"]}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLM(str(tmp_path), enforce_eager=True)


def test_request_that_outgrows_a_tiny_pool_finishes_with_length(quantization):
    llm = LLM("tiny-random", enforce_eager=True, num_kv_blocks=4, block_size=16,  # 64 tokens of KV in all
              quantization=quantization)
    out = llm.generate([[7] * 40], SamplingParams(temperature=0, max_tokens=100,
                                                  ignore_eos=True))
    assert out[0].outputs[0].finish_reason == "length"
    assert len(out[0].outputs[0].token_ids) == 24
    assert_no_leaks(llm.engine)
