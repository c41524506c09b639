"""P/D with a KV tier on the decode replica: blocks a transfer brought are offloaded when its
pool evicts them, and a request the decode replica serves whole (a gateway's bypass) restores
them from its own tier."""

import dataclasses

from backend_engine.async_engine import AsyncLLMEngine
from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.kv_transfer.pd_pair import config, pd_generate, run, settled

PREFIX = [300 + i for i in range(96)]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


async def test_a_decode_replica_restores_transferred_blocks_from_its_tier():
    # lru: the transferred blocks served a hit (their claim), which SLRU would protect
    small = dict(num_kv_blocks=24, kv_offload_size_gb=0.01, eviction_policy="lru")
    engines = {"both": AsyncLLMEngine(config()),
               "prefill": AsyncLLMEngine(config("prefill")),
               "decode": AsyncLLMEngine(dataclasses.replace(config("decode"), **small))}
    try:
        for engine in engines.values():
            await engine.start()
        first = await pd_generate(engines["prefill"], engines["decode"], PREFIX + [1], GREEDY)
        assert first.transfer.ok and first.transfer.blocks_sent == 6
        for i in range(8):  # whole requests through the decode replica's 24-block pool
            await run(engines["decode"], [2000 + 131 * i + j for j in range(96)], GREEDY)
        reference = await run(engines["both"], PREFIX + [5, 6, 7], GREEDY)
        out = await run(engines["decode"], PREFIX + [5, 6, 7], GREEDY)
        assert out.num_cached_tokens == 96
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
        assert engines["decode"].engine.load()["kv_tier"]["hit_tokens"] == 96
        assert settled(engines["prefill"], engines["decode"])
    finally:
        for engine in engines.values():
            await engine.shutdown()
