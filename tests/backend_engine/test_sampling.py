"""Sampling: seeds, support restriction, stops, penalties, logprobs, n > 1."""

import math

import torch

from backend_engine.detokenizer import IncrementalDetokenizer
from backend_engine.sampler import Sampler, SamplingRow
from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.helpers import assert_no_leaks

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def test_same_seed_same_text_different_seed_differs(default_llm):
    p = dict(temperature=1.0, max_tokens=24, ignore_eos=True)
    a = default_llm.generate(PROMPT, SamplingParams(seed=7, **p))[0].outputs[0].token_ids
    b = default_llm.generate(PROMPT, SamplingParams(seed=7, **p))[0].outputs[0].token_ids
    c = default_llm.generate(PROMPT, SamplingParams(seed=8, **p))[0].outputs[0].token_ids
    assert a == b and a != c


def test_seeded_output_does_not_depend_on_batch_neighbours(default_llm):
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True)
    alone = default_llm.generate(PROMPT, params)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = default_llm.generate([PROMPT, "Other text", "More"], [params, noise, noise])
    assert batch[0].outputs[0].token_ids == alone


def _rows(params, batch):
    return [SamplingRow(params, [1, 2], [], None, []) for _ in range(batch)]


def test_top_k_restricts_support_to_k_most_likely():
    torch.manual_seed(0)
    logits = torch.randn(1, 50).repeat(2000, 1)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    out = Sampler(0)(logits.clone(), _rows(SamplingParams(temperature=1.0, top_k=3), 2000))
    assert set(out.token_ids) == allowed  # all three appear in 2000 draws, nothing else


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0).repeat(3000, 1)
    out = Sampler(0)(logits, _rows(SamplingParams(temperature=1.0, top_p=0.7), 3000))
    assert set(out.token_ids) == {0, 1}
    share = out.token_ids.count(0) / 3000
    assert abs(share - 0.5 / 0.8) < 0.05  # renormalised inside the kept set


def test_min_p_drops_tokens_below_fraction_of_max():
    logits = torch.tensor([0.6, 0.3, 0.05, 0.05]).log().unsqueeze(0).repeat(2000, 1)
    out = Sampler(0)(logits, _rows(SamplingParams(temperature=1.0, min_p=0.2), 2000))
    assert set(out.token_ids) == {0, 1}


def test_penalties_and_logit_bias_change_the_argmax():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    biased = Sampler(0)(logits.clone(), [SamplingRow(
        SamplingParams(temperature=0, logit_bias={2: 5.0}), [0], [], None, [])])
    assert biased.token_ids == [2]
    penalised = Sampler(0)(logits.clone(), [SamplingRow(
        SamplingParams(temperature=0, frequency_penalty=2.0), [0], [0, 0], None, [])])
    assert penalised.token_ids == [1]
    repeated = Sampler(0)(logits.clone(), [SamplingRow(
        SamplingParams(temperature=0, repetition_penalty=2.0), [0], [], None, [])])
    assert repeated.token_ids == [0]  # 2.0/2 = 1.0 ties with token 1; argmax takes first
    blocked = Sampler(0)(logits.clone(), [SamplingRow(
        SamplingParams(temperature=0), [0], [], None, [0])])
    assert blocked.token_ids == [1]


def test_logprobs_are_normalised_and_top_sorted(default_llm):
    out = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=5,
                                                               ignore_eos=True))
    lps = out[0].outputs[0].logprobs
    assert len(lps) == 4
    for lp in lps:
        assert lp.logprob <= 0 and len(lp.top) == 5
        assert lp.top[0][0] == lp.token_id  # greedy: the chosen token is the most likely
        values = [v for _, _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-4


class _CharTokenizer:
    """One character per token: makes token-boundary cases explicit."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_stop_string_split_across_tokens_is_found_and_never_streamed():
    detok = IncrementalDetokenizer(_CharTokenizer(), [ord("x")], ["STOP"])
    streamed, stop = "", None
    for ch in "hello STOP world":
        stop = detok.add_token(ord(ch))
        streamed += detok.take_delta(finished=stop is not None)
        if stop:
            break
    assert stop == "STOP"
    assert detok.text == "hello " and streamed == "hello "


def test_stop_string_ends_generation_in_the_engine(default_llm):
    free = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32))
    text = free[0].outputs[0].text
    stop = text[5:8]  # a stop string that appears in the greedy text, likely spanning tokens
    out = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32, stop=[stop]))
    o = out[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == text[:text.index(stop)]
    assert_no_leaks(default_llm.engine)


def test_stop_token_ids_and_max_tokens_finish_reasons(default_llm):
    first = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3,
                                                        ignore_eos=True))
    o = first[0].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 3
    stop_id = o.token_ids[1]
    out = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10,
                                                      stop_token_ids=[stop_id]))
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].stop_reason == stop_id


def test_n_samples_share_the_prompt_blocks_and_differ(default_llm):
    engine = default_llm.engine
    prompt = "Tell me a story about a robot. " * 8
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    out = default_llm.generate(prompt, params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert_no_leaks(engine)


def test_min_tokens_suppresses_eos(default_llm):
    eos = next(iter(default_llm.engine.eos_token_ids))
    out = default_llm.generate("Hi", SamplingParams(temperature=0, max_tokens=20, min_tokens=20,
                                                    logit_bias={eos: 100.0}))
    assert len(out[0].outputs[0].token_ids) == 20 and eos not in out[0].outputs[0].token_ids
