"""Grammar-constrained decoding in the engine: valid output whatever the weights, composed with
continuous batching, chunked prefill, n > 1, preemption, abort, stop strings, logprobs and
speculative decoding; compilation never blocks the step loop."""

from __future__ import annotations

import json
import math
import re
import threading
from concurrent.futures import Future

import jsonschema
import pytest

from backend_engine.errors import InvalidRequestError
from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from backend_engine.structured import StructuredOutputsParams
from tests.backend_engine.helpers import assert_no_leaks

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                  "maxItems": 3}}}


def constrained(max_tokens: int = 200, **kw) -> SamplingParams:
    spec = {k: kw.pop(k) for k in ("json", "regex", "choice", "grammar", "json_object")
            if k in kw}
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec),
                          **kw)


def test_json_schema_output_validates_for_every_choice(tiny_llm):
    out = tiny_llm.generate(["Tell me", "About"], constrained(json=PERSON, n=3, temperature=1.0,
                                                              seed=7))
    for request in out:
        for choice in request.outputs:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.text), PERSON)
    assert len({c.text for c in out[0].outputs}) > 1  # each choice has its own matcher
    assert_no_leaks(tiny_llm.engine)


def test_non_ascii_text_before_a_hex_digit_survives_the_grammar_rewrite(tiny_llm):
    # xgrammar prints "é" then "a" as "\xe9a", which it would read back as U+0E9A; a bounded
    # string makes the engine rewrite (print and read back) the grammar
    schema = {"type": "object", "additionalProperties": False,
              "required": ["name", "code", "note"],
              "properties": {"name": {"enum": ["éa", "ÿF0"]}, "code": {"const": "ñ1"},
                             "note": {"type": "string", "maxLength": 2}}}
    out = tiny_llm.generate("JSON:", constrained(json=schema, n=4, temperature=1.0, seed=3,
                                                 max_tokens=300))
    for choice in out[0].outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), schema)


@pytest.mark.parametrize("spec,check", [
    ({"regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
    ({"grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'},
     lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
])
def test_regex_choice_and_grammar(tiny_llm, spec, check):
    for temperature in (0.0, 1.0):
        out = tiny_llm.generate("Answer:", constrained(temperature=temperature, seed=1,
                                                       max_tokens=300, **spec))
        choice = out[0].outputs[0]
        assert choice.finish_reason == "stop", choice.text
        assert check(choice.text), choice.text


def test_json_object_is_any_json_object(default_llm):
    # unbounded (strings of any length): a real model, which closes what it opens
    messages = [{"role": "user", "content": "Give a JSON object with keys name and color for a cat."}]
    out = default_llm.chat(messages, constrained(json_object=True, temperature=0, max_tokens=200))
    assert out[0].outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(out[0].outputs[0].text), dict)


def test_constrained_and_free_sequences_share_steps(tiny_llm):
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = tiny_llm.generate(["free one", "free two"], free)
    mixed = tiny_llm.generate(["free one", "json please", "free two"],
                              [free, constrained(json=PERSON, temperature=0), free])
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2])] == \
        [o.outputs[0].token_ids for o in alone]  # masks stay on their own rows
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), PERSON)


def test_chunked_prefill_and_preemption_keep_output_valid_and_identical():
    prompts = [" ".join(f"word{i}-{j}" for j in range(40)) for i in range(6)]
    params = constrained(json=PERSON, temperature=0, max_tokens=120)
    roomy = LLM("tiny-random", enforce_eager=True, num_kv_blocks=256, max_num_batched_tokens=512)
    reference = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    # prompts of ~130 tokens in 48-token chunks, and too few blocks for all six at once
    tight = LLM("tiny-random", enforce_eager=True, num_kv_blocks=40, max_num_batched_tokens=48)
    out = tight.generate(prompts, params)
    assert tight.engine.stats.preemptions > 0
    assert [o.outputs[0].token_ids for o in out] == reference
    for o in out:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    assert_no_leaks(tight.engine)


def test_stop_string_ends_constrained_output_early(tiny_llm):
    out = tiny_llm.generate("x", constrained(regex=r"abc(de|fg)xyz", temperature=0,
                                             stop=["fg", "de"]))
    choice = out[0].outputs[0]
    assert choice.text == "abc" and choice.finish_reason == "stop"
    assert choice.stop_reason in ("fg", "de")


def test_logprobs_are_those_of_the_masked_distribution(tiny_llm):
    out = tiny_llm.generate("Pick:", constrained(choice=["yes", "no"], temperature=1.0, seed=3,
                                                 logprobs=20))
    first = out[0].outputs[0].logprobs[0]
    finite = [(text, lp) for _, text, lp in first.top if lp > -math.inf]
    # only the few tokens that start "yes" or "no" have probability, and they hold all of it
    assert finite and all(text and ("yes".startswith(text) or "no".startswith(text))
                          for text, _ in finite)
    assert math.isclose(sum(math.exp(lp) for _, lp in finite), 1.0, rel_tol=1e-4)
    assert first.logprob > -math.inf


def test_min_tokens_cannot_push_past_a_complete_grammar(tiny_llm):
    out = tiny_llm.generate("x", constrained(choice=["ok"], temperature=0, min_tokens=5))
    assert out[0].outputs[0].text == "ok"
    assert out[0].outputs[0].finish_reason == "stop"


def test_invalid_constraints_are_refused_naming_the_field(tiny_llm):
    bad = [({"json": {"type": "strang"}}, "Unsupported type"),
           ({"regex": "(ab"}, "parenthesis"),
           ({"grammar": "root ::= missing_rule"}, "missing_rule")]
    for spec, message in bad:
        with pytest.raises(InvalidRequestError, match=message) as err:
            tiny_llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(
                **spec, param="response_format.json_schema.schema")))
        assert err.value.param == "response_format.json_schema.schema"
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(json=PERSON, regex="a")
    assert_no_leaks(tiny_llm.engine)


def test_a_request_waits_for_its_grammar_while_others_run(tiny_llm, monkeypatch):
    engine = tiny_llm.engine
    gate, compiled = threading.Event(), Future()
    real_submit = engine.structured.compiler.submit

    def slow_submit(params):
        real = real_submit(params)
        threading.Thread(target=lambda: (gate.wait(30), compiled.set_result(real.result())),
                         daemon=True).start()
        return compiled

    monkeypatch.setattr(engine.structured.compiler, "submit", slow_submit)
    engine.add_request("grammar", [5, 6, 7], constrained(json=PERSON, temperature=0))
    engine.add_request("free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8,
                                                         ignore_eos=True))
    assert engine.load()["waiting"] == 2
    finished = set()
    while "free" not in finished:
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert "grammar" in engine.requests and not finished - {"free"}
    gate.set()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    assert_no_leaks(engine)


def test_abort_while_compiling_and_while_generating_leaks_nothing(tiny_llm, monkeypatch):
    engine = tiny_llm.engine
    pending = Future()
    monkeypatch.setattr(engine.structured.compiler, "submit", lambda params: pending)
    engine.add_request("compiling", [1, 2, 3], constrained(json=PERSON))
    out = engine.abort_request("compiling")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.structured.num_pending_seqs == 0
    monkeypatch.undo()
    engine.add_request("running", [1, 2, 3], constrained(json=PERSON, max_tokens=400, n=2))
    for _ in range(4):
        engine.step()
    assert engine.abort_request("running").finished
    assert_no_leaks(engine)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_drafts_are_checked_against_the_grammar(tiny_llm, quantization, temperature):
    # the draft model is the target itself: its drafts are the free greedy continuation, which
    # the grammar cuts short, so verification and rollback run on every step
    prompts = ["json one", "json two", "free"]
    params = [constrained(json=PERSON, temperature=temperature, seed=5),
              constrained(regex=r"[a-c]{2,9}!", temperature=temperature, seed=6),
              SamplingParams(temperature=temperature, seed=7, max_tokens=30, ignore_eos=True)]
    spec = LLM("tiny-random", enforce_eager=True, num_kv_blocks=256, speculative_method="draft",
               draft_model="tiny-random", num_speculative_tokens=3, quantization=quantization)
    out = spec.generate(prompts, params)
    jsonschema.validate(json.loads(out[0].outputs[0].text), PERSON)
    assert re.fullmatch(r"[a-c]{2,9}!", out[1].outputs[0].text)
    assert spec.engine.spec.stats.drafted_tokens > 0
    if temperature == 0.0:  # greedy: identical with speculation on and off
        reference = tiny_llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in out] == \
            [o.outputs[0].token_ids for o in reference]
    assert_no_leaks(spec.engine)
