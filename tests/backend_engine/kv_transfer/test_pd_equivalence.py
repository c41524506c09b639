"""Greedy output through a prefill engine and a decode engine is token-identical to one `both`
engine: with and without prefix hits on either side, with chunked prefill, n > 1 and
speculative decoding on the decode side; and neither side keeps a block afterwards."""

import threading
import time

import pytest

from backend_engine.async_engine import AsyncLLMEngine
from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.kv_transfer.pd_pair import config, pd_generate, run, settled

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompt(seed: int, length: int) -> list[int]:
    """Distinct prompts per test, so no test sees another's cached blocks."""
    return [(seed * 7919 + i * 31) % 40000 + 100 for i in range(length)]


@pytest.fixture(scope="module")
def engines():
    made = {"both": AsyncLLMEngine(config()),
            "prefill": AsyncLLMEngine(config("prefill")),
            "decode": AsyncLLMEngine(config("decode")),
            # a prefill engine with small chunks (32-token budget, odd threshold)
            "chunked": AsyncLLMEngine(config("prefill", max_num_batched_tokens=32,
                                             long_prefill_token_threshold=27)),
            # decode engines that speculate: n-gram, and a draft model equal to the target
            "ngram": AsyncLLMEngine(config("decode", speculative_method="ngram",
                                           ngram_min=1)),
            "draft": AsyncLLMEngine(config("decode", speculative_method="draft",
                                           draft_model="tiny-random"))}
    yield made
    for engine in made.values():
        engine.engine.close()


@pytest.fixture()
async def started(engines):
    for engine in engines.values():
        await engine.start()
    return engines


@pytest.mark.parametrize("length", [5, 16, 47, 64, 200])
async def test_greedy_pd_matches_one_both_engine(started, length):
    e = started
    tokens = prompt(length, length)
    reference = await run(e["both"], tokens, GREEDY)
    result = await pd_generate(e["prefill"], e["decode"], tokens, GREEDY)
    assert result.transfer.ok
    assert result.tokens() == [reference.outputs[0].token_ids]
    assert result.transfer.blocks_sent == length // 16
    # the decode engine computed only what no transferred block covers
    assert e["decode"].engine.stats.prefix_cache_hits >= length // 16 * 16
    assert settled(e["prefill"], e["decode"])


async def test_prefix_hit_on_the_prefill_side(started):
    e = started
    system = prompt(1, 96)
    await run(e["prefill"], system + [5, 6, 7], GREEDY)  # warms the prefill engine only
    tokens = system + prompt(2, 40)
    reference = await run(e["both"], tokens, GREEDY)
    result = await pd_generate(e["prefill"], e["decode"], tokens, GREEDY)
    assert result.prefill.num_cached_tokens == 96
    assert result.decode.num_cached_tokens == 96  # usage reports what the prefill side reused
    assert result.transfer.blocks_sent == len(tokens) // 16  # the decode side had none of it
    assert result.tokens() == [reference.outputs[0].token_ids]
    assert settled(e["prefill"], e["decode"])


async def test_prefix_hit_on_the_decode_side_sends_only_the_rest(started):
    e = started
    system = prompt(3, 128)
    await run(e["decode"], system + [9], GREEDY)  # warms the decode engine only
    tokens = system + prompt(4, 50)
    reference = await run(e["both"], tokens, GREEDY)
    result = await pd_generate(e["prefill"], e["decode"], tokens, GREEDY, hint=8)
    assert result.prefill.num_cached_tokens == 0
    assert result.transfer.blocks_needed == len(tokens) // 16 - 8
    assert result.tokens() == [reference.outputs[0].token_ids]
    assert settled(e["prefill"], e["decode"])


async def test_prefix_hits_on_both_sides(started):
    e = started
    system = prompt(5, 80)
    await run(e["prefill"], system + [1], GREEDY)
    await run(e["decode"], system + [2], GREEDY)
    tokens = system + prompt(6, 33)
    reference = await run(e["both"], tokens, GREEDY)
    result = await pd_generate(e["prefill"], e["decode"], tokens, GREEDY)
    assert result.prefill.num_cached_tokens == 80
    assert result.transfer.blocks_needed == len(tokens) // 16 - 5
    assert result.tokens() == [reference.outputs[0].token_ids]
    assert settled(e["prefill"], e["decode"])


async def test_chunked_prefill_streams_blocks_while_computing(started):
    e = started
    tokens = prompt(7, 300)
    reference = await run(e["both"], tokens, GREEDY)
    result = await pd_generate(e["chunked"], e["decode"], tokens, GREEDY)
    assert result.transfer.blocks_sent == 300 // 16
    assert result.tokens() == [reference.outputs[0].token_ids]
    assert settled(e["chunked"], e["decode"])


async def test_n_greater_than_one(started):
    e = started
    tokens = prompt(8, 70)
    params = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    reference = await run(e["both"], tokens, params)
    result = await pd_generate(e["prefill"], e["decode"], tokens, params)
    assert result.transfer.blocks_sent == 70 // 16  # the prompt's blocks travel once
    assert result.tokens() == [c.token_ids for c in reference.outputs]
    assert settled(e["prefill"], e["decode"])


async def test_seeded_sampling_with_n_completes_and_is_reproducible(started):
    e = started
    tokens = prompt(9, 40)
    params = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=6, ignore_eos=True)
    first = await pd_generate(e["prefill"], e["decode"], tokens, params)
    again = await pd_generate(e["prefill"], e["decode"], tokens, params)
    assert first.tokens() == again.tokens() and all(len(t) == 6 for t in first.tokens())
    assert settled(e["prefill"], e["decode"])


@pytest.mark.parametrize("method", ["ngram", "draft"])
async def test_speculative_decoding_on_the_decode_side(started, method):
    e = started
    motif = prompt(10, 24)
    tokens = motif * 5  # repetitive: n-gram drafts find matches
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = await run(e["both"], tokens, params)
    before = e[method].spec_stats.drafted_tokens
    result = await pd_generate(e["prefill"], e[method], tokens, params)
    assert result.tokens() == [reference.outputs[0].token_ids]
    assert e[method].spec_stats.drafted_tokens > before  # drafts were verified
    assert settled(e["prefill"], e[method])


async def test_first_token_that_ends_the_request_needs_no_decoding(started):
    e = started
    tokens = prompt(11, 50)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
    reference = await run(e["both"], tokens, params)
    result = await pd_generate(e["prefill"], e["decode"], tokens, params)
    out, ref = result.decode.outputs[0], reference.outputs[0]
    assert out.token_ids == ref.token_ids and out.finish_reason == "length"
    assert out.logprobs[0].token_id == ref.logprobs[0].token_id
    assert out.logprobs[0].logprob == pytest.approx(ref.logprobs[0].logprob, abs=1e-4)
    assert [t for t, _, _ in out.logprobs[0].top] == [t for t, _, _ in ref.logprobs[0].top]
    assert settled(e["prefill"], e["decode"])


async def test_a_decode_request_that_arrives_before_its_blocks_are_registered(started):
    e = started
    connector = e["decode"].engine.kv_connector
    honest_complete, honest_apply = connector.complete, connector._complete
    handed_over = []

    def late(transfer_id, received):  # the registration reaches the engine thread late:
        def when_the_request_is_in():  # only once the request has tried to claim it
            while transfer_id not in connector._awaiting:
                time.sleep(0.01)
            honest_complete(transfer_id, received)
        threading.Thread(target=when_the_request_is_in, daemon=True).start()

    def apply(transfer_id, received):
        handed_over.append(transfer_id in connector._awaiting)
        honest_apply(transfer_id, received)

    connector.complete, connector._complete = late, apply
    try:
        tokens = prompt(12, 90)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        reference = await run(e["both"], tokens, params)
        result = await pd_generate(e["prefill"], e["decode"], tokens, params)
    finally:
        del connector.complete, connector._complete
    assert result.tokens() == [reference.outputs[0].token_ids]
    assert handed_over == [True]  # the waiting request took the blocks over
    assert settled(e["prefill"], e["decode"])
