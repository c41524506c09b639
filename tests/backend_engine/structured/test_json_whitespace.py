"""The JSON whitespace policy (`disable_any_whitespace`): compact JSON by default — a grammar
that lets no gap hold whitespace, so every answer ends within a bound set by its schema — and,
opted into, at most a space or a newline plus bounded indentation per gap. Checked on the
grammars (json, json_object, forced tool calls) and by random walks over the default model's
tokenizer (a model that picks any token the grammar allows)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xgrammar.testing import _is_grammar_accept_string as accepts

from backend_engine.structured import StructuredOutputsParams
from backend_engine.structured.compiler import MAX_JSON_INDENT, grammar_of
from backend_engine.tool_parsers import HermesToolParser
from tests.backend_engine.structured.json_schemas import json_schemas

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "tags": {"type": "array", "items": {"type": "integer"}}},
          "required": ["name", "tags"], "additionalProperties": False}
TOOL = HermesToolParser().forced_format([("f", SCHEMA)], "f")
COMPACT = '{"name":"a b","tags":[1,2]}'
PRETTY = '{\n  "name": "a b",\n  "tags": [\n    1,\n    2\n  ]\n}'


def _params(kind: str, compact: bool) -> StructuredOutputsParams:
    spec = {"json": {"json": SCHEMA}, "json_object": {"json_object": True},
            "structural_tag": {"structural_tag": TOOL}}[kind]
    return StructuredOutputsParams(**spec, disable_any_whitespace=compact)


def _call(arguments: str) -> str:
    return f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'


@pytest.mark.parametrize("kind", ["json", "json_object", "structural_tag"])
def test_compact_by_default_and_bounded_pretty_when_asked(kind):
    wrap = _call if kind == "structural_tag" else (lambda text: text)
    compact, pretty = grammar_of(_params(kind, True)), grammar_of(_params(kind, False))
    assert StructuredOutputsParams(json=SCHEMA).disable_any_whitespace  # the default
    assert accepts(compact, wrap(COMPACT)) and accepts(pretty, wrap(COMPACT))
    assert not accepts(compact, wrap(PRETTY)) and accepts(pretty, wrap(PRETTY))
    assert not accepts(compact, wrap('{"name": "a b","tags":[1,2]}'))
    assert accepts(compact, wrap('{"name":"a  b\\n","tags":[]}'))  # inside strings: anything
    assert not accepts(pretty, wrap('{\n\n"name":"x","tags":[]}'))  # two newlines in a gap
    indent = " " * MAX_JSON_INDENT
    assert accepts(pretty, wrap(f'{{\n{indent}"name":"x","tags":[]}}'))
    assert not accepts(pretty, wrap(f'{{\n{indent} "name":"x","tags":[]}}'))
    assert not accepts(pretty, wrap('{  "name":"x","tags":[]}'))  # two spaces


def test_the_policy_is_part_of_the_grammar_cache_key():
    assert _params("json", True).key != _params("json", False).key


# ---- random walks: a "model" choosing uniformly among the tokens the grammar allows -------


@pytest.fixture(scope="module")
def compiler():
    from transformers import AutoTokenizer

    from backend_engine.model_loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny-random").folder)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                              stop_token_ids=[tokenizer.eos_token_id])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False), tokenizer


def max_bytes(schema: dict) -> int:
    """The most UTF-8 bytes a compact instance of `schema` (as json_schemas builds them) takes."""
    if "anyOf" in schema:
        return max(map(max_bytes, schema["anyOf"]))
    if "enum" in schema or "const" in schema:
        values = schema.get("enum") or [schema["const"]]
        return max(len(json.dumps(v, ensure_ascii=a).encode()) for v in values for a in (0, 1))
    kind = schema["type"]
    if isinstance(kind, list):  # ["integer", "null"]: 0-9 or null
        return 4
    if kind == "object":
        props = schema["properties"]
        return 1 + sum(len(json.dumps(k)) + 2 + max_bytes(v) for k, v in props.items())
    if kind == "array":
        return 1 + schema["maxItems"] * (max_bytes(schema["items"]) + 1) + 1
    if kind == "string":  # a character is at most a 6-byte escape; each pattern is longer
        return 2 + (6 * schema["maxLength"] if "maxLength" in schema else len(schema["pattern"]))
    if kind in ("integer", "number"):  # a sign, digits; a number's point and 6 decimals
        digits = max(len(str(abs(schema["minimum"]))), len(str(abs(schema["maximum"]))))
        return 1 + digits + (7 if kind == "number" else 0)
    return {"boolean": 5, "null": 4}[kind]


def random_walk(compiled: xgr.CompiledGrammar, rng: random.Random, limit: int) -> list[int]:
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    tokens: list[int] = []
    while not matcher.is_terminated() and len(tokens) < limit:
        matcher.fill_next_token_bitmask(bitmask)
        logits = torch.zeros(1, compiled.tokenizer_info.vocab_size)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
        token = rng.choice(allowed)
        assert matcher.accept_token(token)
        tokens.append(token)
    return tokens


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=json_schemas(max_leaves=6), seed=st.integers(0, 2**16))
def test_random_schemas_finish_valid_within_a_bound_set_by_the_schema(compiler, schema, seed):
    grammars, tokenizer = compiler
    compiled = grammars.compile_grammar(grammar_of(StructuredOutputsParams(json=schema)))
    bound = max_bytes(schema) + 1  # a token holds at least one byte; then the stop token
    tokens = random_walk(compiled, random.Random(seed), limit=bound + 1)
    assert len(tokens) <= bound and tokens[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(tokens[:-1])
    jsonschema.validate(json.loads(text), schema)
