"""Our model code against transformers' own implementation of the default model, in fp32."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from backend_engine.attention.metadata import AttentionMetadata, PrefillChunk
from backend_engine.model_loader import resolve_model
from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.helpers import assert_no_leaks

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who",
    "List three fruits:",
    "Q: What is 12 times 7?\nA:",
    "The quick brown fox",
    "Translate to German: Good morning, how are you today? I hope the weather is nice where "
    "you live, because here it has been raining for three days without a break.",
    "import numpy as np\n\n# compute the mean of a list of numbers\ndef mean(xs):",
    "A",
]
NEW_TOKENS = 32
LOGIT_ATOL = 2e-3  # fp32, different op order (fused qkv, paged gather) than transformers


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(resolve_model("default").folder,
                                                dtype=torch.float32).eval()


def test_greedy_tokens_match_transformers(default_llm, hf_model):
    tok = default_llm.tokenizer
    # min_tokens blocks EOS exactly as HF's min_new_tokens does, so all 32 tokens are compared
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = default_llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist(), prompt
    assert_no_leaks(default_llm.engine)


def test_prompt_logits_close_to_transformers(default_llm, hf_model):
    model = default_llm.engine.runner.model
    ids = default_llm.tokenizer.encode(PROMPTS[6])
    n, block = len(ids), 16
    num_blocks = -(-n // block)
    shape = (num_blocks, block, model.num_kv_heads, model.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    slots = torch.arange(n)
    meta = AttentionMetadata(slot_mapping=slots,
                             prefills=[PrefillChunk(0, n, n, torch.arange(num_blocks))])
    ours = model.compute_logits(model.forward(torch.tensor(ids), torch.arange(n), caches, meta))
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, ref, atol=LOGIT_ATOL, rtol=0), (ours - ref).abs().max()
