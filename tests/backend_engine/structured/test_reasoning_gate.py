"""Structured outputs wait for the end of the reasoning (vLLM's rule, `reasoning_end`): nothing
is masked while the model thinks, the grammar applies from the token after the end marker (even
one that spans tokens, or one inside a speculative draft)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from backend_engine.sampling_params import SamplingParams
from backend_engine.structured import StructuredOutputsParams
from backend_engine.structured.compiler import grammar_of
from backend_engine.structured.matcher import ReasoningWatch, SequenceGrammar
from tests.backend_engine.helpers import assert_no_leaks
from tests.backend_engine.structured.test_structured_engine import PERSON


@pytest.fixture(scope="module")
def tokenizer_and_compiled():
    from transformers import AutoTokenizer

    from backend_engine.model_loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny-random").folder)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                              stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return tokenizer, compiler.compile_grammar(grammar_of(StructuredOutputsParams(json_object=True)))


def _gated(compiled) -> SequenceGrammar:
    return SequenceGrammar(compiled, ReasoningWatch("</think>", compiled.tokenizer_info.decoded_vocab))


def _allowed(grammar: SequenceGrammar, vocab_size: int, drafts: list[int]) -> list[int]:
    """How many tokens each bitmask row allows."""
    bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, vocab_size)
    grammar.fill(bitmask, 0, drafts)
    bools = xgr.testing.bitmask_to_bool_mask(bitmask, vocab_size)
    return bools.sum(dim=1).tolist()


def test_the_grammar_applies_after_the_end_marker(tokenizer_and_compiled):
    tokenizer, compiled = tokenizer_and_compiled
    grammar = _gated(compiled)
    vocab = compiled.tokenizer_info.vocab_size
    thinking = tokenizer.encode("Not JSON at all </thi", add_special_tokens=False)
    for token in thinking:
        assert grammar.accept(token) and not grammar.is_terminated
    assert _allowed(grammar, vocab, []) == [vocab]  # nothing masked while thinking
    rest = tokenizer.encode("nk>", add_special_tokens=False)  # the marker spans tokens
    brace = tokenizer.encode("{", add_special_tokens=False)
    assert grammar.valid_prefix(rest + brace + brace) == len(rest)  # drafts past the end: cut
    rows = _allowed(grammar, vocab, rest)
    assert rows[:len(rest)] == [vocab] * len(rest) and rows[-1] < 10  # then JSON's first token
    for token in rest:
        grammar.accept(token)
    assert grammar.reasoning is None
    assert not grammar.accept(tokenizer.encode("x", add_special_tokens=False)[0])
    for token in tokenizer.encode("{}", add_special_tokens=False) + [tokenizer.eos_token_id]:
        assert grammar.accept(token)
    assert grammar.is_terminated


def test_engine_leaves_the_reasoning_free_then_holds_the_answer_to_the_schema(tiny_llm):
    prompt = "Think first:"
    free = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    marker = free.text  # the random model's own first tokens stand in for "</think>"
    params = SamplingParams(temperature=0, max_tokens=300, reasoning_end=marker,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    out = tiny_llm.generate(prompt, params)[0].outputs[0]
    assert out.token_ids[:3] == free.token_ids  # unmasked while "reasoning"
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text[len(marker):]), PERSON)
    assert_no_leaks(tiny_llm.engine)
