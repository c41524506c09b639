"""Request priority through the engine (tiny random model): urgent requests overtake batch work,
preemption by priority changes no greedy token, bad priorities are refused and leave nothing."""

import asyncio

import pytest

from backend_engine.async_engine import AsyncLLMEngine
from backend_engine.config import EngineConfig
from backend_engine.errors import InvalidRequestError
from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.helpers import assert_no_leaks

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
BATCH = [[(7 * i + j) % 500 + 3 for j in range(40)] for i in range(6)]
CHAT = [[(11 * i + j) % 400 + 5 for j in range(20)] for i in range(2)]


def _run(llm: LLM, arrivals: list[tuple[int, str, list[int], int]]) -> tuple[dict, list[str]]:
    """Steps the engine, adding (step, id, prompt, priority) when their step comes; returns
    every request's tokens and the order in which they finished."""
    engine = llm.engine
    pending = sorted(arrivals, key=lambda a: a[0])
    tokens, finished, t = {}, [], 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= t:
            _, rid, prompt, prio = pending.pop(0)
            engine.add_request(rid, prompt, GREEDY, priority=prio)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
                finished.append(out.request_id)
        t += 1
    return tokens, finished


@pytest.fixture(scope="module")
def reference(tiny_llm):
    outs = tiny_llm.generate(BATCH + CHAT, GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def test_priority_preemption_changes_no_greedy_token(reference, quantization, request):
    if quantization == "int8":
        # Open (issue #15): a recomputed prefill and the decode steps it replaces differ in the
        # last fp32 bits (SDPA vs grouped decode attention); the int8 kernel rounds activations
        # to bf16, which can turn that into a one-ulp step and, rarely, a different greedy token
        # (seen once, token 20 of 24, after main's grouped decode attention).
        request.applymarker(pytest.mark.xfail(reason="bf16 activation rounding amplifies "
                                                     "prefill/decode attention differences"))
    # 12 blocks of 16 tokens cannot hold six 64-token batch sequences: the chats preempt them
    llm = LLM("tiny-random", enforce_eager=True, num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=64,
              quantization=quantization)
    arrivals = [(0, f"batch-{i}", p, 5) for i, p in enumerate(BATCH)]
    arrivals += [(6, f"chat-{i}", p, 0) for i, p in enumerate(CHAT)]
    tokens, _ = _run(llm, arrivals)
    assert llm.engine.stats.preemptions > 0
    assert [tokens[f"batch-{i}"] for i in range(6)] + [tokens["chat-0"], tokens["chat-1"]] \
        == reference
    assert_no_leaks(llm.engine)


def test_urgent_requests_overtake_queued_batch_work():
    llm = LLM("tiny-random", enforce_eager=True, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    arrivals = [(0, f"batch-{i}", p, 5) for i, p in enumerate(BATCH)]
    arrivals += [(3, "chat-0", CHAT[0], 0)]
    _, finished = _run(llm, arrivals)
    assert finished.index("chat-0") <= 1  # before every batch request but one running beside it

    fcfs = LLM("tiny-random", enforce_eager=True, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64,
               scheduling_policy="fcfs")
    _, finished = _run(fcfs, arrivals)
    assert finished[-1] == "chat-0"  # under FCFS it waits for the whole flood
    assert_no_leaks(llm.engine)
    assert_no_leaks(fcfs.engine)


def test_llm_generate_takes_one_priority_per_prompt(tiny_llm):
    outs = tiny_llm.generate(BATCH[:2], GREEDY, priority=[3, -1])
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    with pytest.raises(ValueError, match="one priority"):
        tiny_llm.generate(BATCH[:2], GREEDY, priority=[1, 2, 3])
    assert_no_leaks(tiny_llm.engine)


@pytest.mark.parametrize("bad", [True, 1.5, "1", None])
def test_a_non_integer_priority_is_refused_and_adds_nothing(tiny_llm, bad):
    with pytest.raises(InvalidRequestError, match="priority") as err:
        tiny_llm.generate(BATCH[:2], GREEDY, priority=[0, bad])
    assert err.value.param == "priority"
    assert_no_leaks(tiny_llm.engine)


def test_engine_load_reports_work_by_priority():
    llm = LLM("tiny-random", enforce_eager=True, num_kv_blocks=64, max_num_seqs=2)
    for i, prio in enumerate((5, 5, 0, 9)):
        llm.engine.add_request(f"r{i}", BATCH[i], GREEDY, priority=prio)
    llm.engine.step()
    by = llm.engine.load()["by_priority"]
    assert by["0"]["running"] == 1 and by["5"]["running"] == 1
    assert by["5"]["waiting"] == 1 and by["9"]["waiting"] == 1
    assert by["9"]["pending_prefill_tokens"] == 40
    for i in range(4):
        llm.engine.abort_request(f"r{i}")
    assert_no_leaks(llm.engine)


def test_async_engine_serves_by_priority():
    async def main():
        engine = AsyncLLMEngine(EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=64,
                                             max_num_seqs=1))
        await engine.start()
        order = []
        started = asyncio.Event()

        async def one(rid, prompt, prio):
            async for out in engine.generate(prompt, GREEDY, rid, priority=prio):
                started.set()
                if out.finished:
                    order.append(rid)

        try:
            first = asyncio.ensure_future(one("batch-0", BATCH[0], 5))
            await started.wait()  # batch-0 holds the only seat
            # queued in this order, in one tick: batch-2 can only start after batch-1 has run
            # to completion, long after the urgent request is queued
            rest = [asyncio.ensure_future(one(f"batch-{i}", BATCH[i], 5)) for i in (1, 2)]
            rest.append(asyncio.ensure_future(one("chat", CHAT[0], 0)))
            await asyncio.gather(first, *rest)
            with pytest.raises(InvalidRequestError):
                async for _ in engine.generate(CHAT[0], GREEDY, "bad", priority=False):
                    pass
        finally:
            await engine.shutdown()
        return order, engine

    order, engine = asyncio.run(main())
    assert order.index("chat") < order.index("batch-2")
    assert_no_leaks(engine.engine)


def test_priority_with_speculative_decoding_changes_no_greedy_token(quantization):
    # Repetitive prompts make the n-gram proposer draft; drafts of batch sequences that yield
    # their budget or get preempted are dropped, never verified late. (This schedule does both
    # to a sequence holding drafts.)
    prompts = [[5, 6, 7, 8] * 10, [9, 10, 11] * 12, [12, 13] * 20]
    chats = [[5 + i, 6, 7, 8] * 3 for i in range(8)]
    plain = LLM("tiny-random", enforce_eager=True, num_kv_blocks=64, quantization=quantization)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts + chats, GREEDY)]
    llm = LLM("tiny-random", enforce_eager=True, num_kv_blocks=10, max_num_seqs=4, max_num_batched_tokens=16,
              quantization=quantization,
              speculative_method="ngram", num_speculative_tokens=3, speculative_max_batch=8)
    arrivals = [(0, f"batch-{i}", p, 5) for i, p in enumerate(prompts)]
    arrivals += [(6 + 4 * i, f"chat-{i}", p, 0) for i, p in enumerate(chats)]
    tokens, _ = _run(llm, arrivals)
    got = [tokens[f"batch-{i}"] for i in range(3)] + [tokens[f"chat-{i}"] for i in range(8)]
    assert got == want
    assert llm.engine.stats.preemptions > 0
    assert llm.engine.spec.stats.drafted_tokens > 0
    assert_no_leaks(llm.engine)
