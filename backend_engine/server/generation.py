"""Running engine requests for one HTTP request: start them (so bad input or a full queue is
still an HTTP status, not an event inside a 200 stream) and merge their streams; a departed
client cancels them (protocol/disconnect.py). Closing an engine generator aborts its
request and frees its blocks at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend_engine.outputs import RequestOutput
from backend_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backend_engine.async_engine import AsyncLLMEngine


class RequestAborted(Exception):
    """The server ended the request (a drain ran out of grace)."""


@dataclass(slots=True)
class Started:
    """One engine request whose first output has arrived."""

    prompt_index: int
    gen: AsyncGenerator[RequestOutput, None]
    first: RequestOutput
    abort: asyncio.Event | None = None  # set: end the request at its next output


async def _start_one(engine: "AsyncLLMEngine", index: int, prompt: list[int], params: SamplingParams,
                     request_id: str, cache_salt: str | None, priority: int, kv_transfer=None) -> Started:  # noqa: ANN001
    gen = engine.generate(prompt, params, request_id, cache_salt=cache_salt, priority=priority,
                          kv_transfer=kv_transfer)
    try:
        first = await gen.__anext__()
    except BaseException:
        await gen.aclose()
        raise
    return Started(index, gen, first)


async def start_generations(engine: "AsyncLLMEngine", prompts: list[list[int]], params: SamplingParams,
                            request_ids: list[str], cache_salt: str | None,
                            abort: asyncio.Event | None = None, priority: int = 0,
                            kv_transfer=None) -> list[Started]:  # noqa: ANN001
    """Submit every prompt and wait for each one's first output; on any failure close them all.
    `kv_transfer` (one prompt only): the request is one half of a prefill/decode pair."""
    tasks = [asyncio.ensure_future(_start_one(engine, i, p, params, rid, cache_salt, priority, kv_transfer))
             for i, (p, rid) in enumerate(zip(prompts, request_ids))]
    try:
        started = list(await asyncio.gather(*tasks))
        for s in started:
            s.abort = abort
        return started
    except BaseException:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await close_all([r for r in results if isinstance(r, Started)])
        raise


async def close_all(started: list[Started]) -> None:
    for s in started:
        await s.gen.aclose()


async def merged(started: list[Started]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every request as it comes; closes every generator on exit."""
    abort = started[0].abort if started else None

    def check_abort() -> None:
        if abort is not None and abort.is_set():
            raise RequestAborted()

    try:
        if len(started) == 1:
            only = started[0]
            yield only.prompt_index, only.first
            if not only.first.finished:
                async for out in only.gen:
                    check_abort()
                    yield only.prompt_index, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(s: Started) -> None:
            try:
                await queue.put((s.prompt_index, s.first))
                if not s.first.finished:
                    async for out in s.gen:
                        await queue.put((s.prompt_index, out))
                await queue.put(None)
            except Exception as exc:
                await queue.put(exc)

        pumps = [asyncio.ensure_future(pump(s)) for s in started]
        try:
            remaining = len(pumps)
            while remaining:
                item = await queue.get()
                check_abort()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
    finally:
        await close_all(started)


async def final_outputs(started: list[Started]) -> list[RequestOutput]:
    """Run every request to completion; the last (cumulative) output of each, by prompt index."""
    last: dict[int, RequestOutput] = {}
    async for index, out in merged(started):
        last[index] = out
    return [last[i] for i in sorted(last)]
