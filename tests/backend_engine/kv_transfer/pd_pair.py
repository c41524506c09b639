"""A prefill engine and a decode engine in this process, driven the way the gateway drives two
replicas: the prefill half with RemoteDecode, then the decode half with its first tokens."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from backend_engine.async_engine import AsyncLLMEngine
from backend_engine.config import EngineConfig
from backend_engine.kv_transfer.base import TransferResult
from backend_engine.kv_transfer.params import FirstToken, RemoteDecode, RemotePrefill
from backend_engine.outputs import RequestOutput
from backend_engine.sampling_params import SamplingParams

MODEL = "tiny-random"
NUM_BLOCKS = 128


def config(role: str = "both", **overrides) -> EngineConfig:
    return EngineConfig(enforce_eager=True, model=MODEL, num_kv_blocks=NUM_BLOCKS, kv_role=role, num_threads=1,
                        kv_transfer_timeout_s=1.0, **overrides)


@dataclass
class PDResult:
    prefill: RequestOutput
    transfer: TransferResult
    decode: RequestOutput

    def tokens(self) -> list[list[int]]:
        return [c.token_ids for c in sorted(self.decode.outputs, key=lambda c: c.index)]


async def run(engine: AsyncLLMEngine, prompt: list[int], params: SamplingParams,
              **kw) -> RequestOutput:
    last = None
    async for out in engine.generate(prompt, params, uuid.uuid4().hex, **kw):
        last = out
    return last


def first_tokens(out: RequestOutput) -> list[FirstToken]:
    tokens = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        lp = c.logprobs[0] if c.logprobs else None
        tokens.append(FirstToken(c.token_ids[0], None if lp is None else lp.logprob,
                                 [] if lp is None else [(t, v) for t, _, v in lp.top]))
    return tokens


async def pd_generate(prefill: AsyncLLMEngine, decode: AsyncLLMEngine, prompt: list[int],
                      params: SamplingParams, hint: int = 0) -> PDResult:
    remote = RemoteDecode(uuid.uuid4().hex, decode.engine.kv_connector.receiver.address, hint)
    p_out = await run(prefill, prompt, params, kv_transfer=remote)
    transfer = await asyncio.wrap_future(remote.result)
    resume = RemotePrefill(first_tokens(p_out), remote.transfer_id if transfer.ok else None,
                           p_out.num_cached_tokens)
    d_out = await run(decode, prompt, params, kv_transfer=resume)
    return PDResult(p_out, transfer, d_out)


def settled(*engines: AsyncLLMEngine, timeout_s: float = 5.0) -> bool:
    """Every block free (cached ones included) and no transfer holding any, within the time."""
    def ok() -> bool:
        try:
            return all(clean(e) for e in engines)
        except RuntimeError:  # a dict the engine thread was changing: look again
            return False

    def clean(e: AsyncLLMEngine) -> bool:
        pool = e.engine.pool
        held = e.engine.kv_connector.load()["held_blocks"] if e.engine.kv_connector else 0
        return not held and pool.num_free_blocks == pool.num_blocks \
            and not e.engine.has_unfinished_requests()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ok():
            return True
        time.sleep(0.02)
    return ok()
