"""Feed the block pool's events to a ZMQ publisher as vLLM batches (`--kv-events-config`): one
batch per engine step that changed the cache, `AllBlocksCleared`, then `BlockRemoved`, then one
`BlockStored` per chain of stored blocks (parent hash, block hashes, token ids; the request's
cache salt as the first block's extra key, as vLLM sends it); then the same for the KV tier
below the pool, under the tier's medium (`tier_medium`). Block hashes are the canonical
ones, so a kvgate gateway and any vLLM-event consumer name the same blocks. The app imports this
module only when publishing is enabled (it needs pyzmq and msgspec)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from backend_engine.block_pool import BlockOrigin, BlockPool, KVEvent
from backend_engine.server.kv_events_config import KVEventsConfig
from backend_engine.server.kv_publisher import ZmqEventPublisher
from protocol.kv_events import (MEDIUM_CPU, MEDIUM_CPU_TIER, MEDIUM_DISK, MEDIUM_GPU,
                                AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch)

if TYPE_CHECKING:
    from backend_engine.server.state import ServerState

logger = logging.getLogger(__name__)


def pool_medium(device: str) -> str:
    return MEDIUM_GPU if str(device).startswith("cuda") else MEDIUM_CPU


def tier_medium(device: str, ram: bool) -> str:
    """The KV tier's medium: vLLM's "CPU" below a GPU pool; below a CPU pool, whose medium
    "CPU" already is, "CPU_TIER"; "DISK" for a tier on disk only."""
    if not ram:
        return MEDIUM_DISK
    return MEDIUM_CPU if pool_medium(device) == MEDIUM_GPU else MEDIUM_CPU_TIER


def to_batch(event: KVEvent, model_id: str, block_size: int, medium: str,
             tier: str | None = None) -> KVEventBatch:
    """One step's changes; the pool's blocks with `medium`, its KV tier's with `tier`."""
    events: list = []
    if event.cleared:
        events.append(AllBlocksCleared())
    if event.removed:
        events.append(BlockRemoved(list(event.removed), medium))
    origins = event.origins or {}
    _stored_runs(events, event.stored, origins, model_id, block_size, medium)
    if tier is not None:
        if event.tier_removed:
            events.append(BlockRemoved(list(event.tier_removed), tier))
        _stored_runs(events, event.tier_stored, origins, model_id, block_size, tier)
    return KVEventBatch(event.ts, events)


def _stored_runs(events: list, stored: list[int], origins: dict[int, BlockOrigin], model_id: str,
                 block_size: int, medium: str) -> None:
    """One BlockStored per chain of consecutive stored blocks."""
    run: list[tuple[int, BlockOrigin]] = []
    for h in _parents_first(stored, origins):
        origin = origins.get(h)
        if origin is None:
            continue  # stored before the publisher asked for origins
        if run and (origin.parent != run[-1][0] or origin.namespace != run[-1][1].namespace):
            events.append(_stored(run, model_id, block_size, medium))
            run = []
        run.append((h, origin))
    if run:
        events.append(_stored(run, model_id, block_size, medium))


def _parents_first(stored: list[int], origins: dict[int, BlockOrigin]) -> list[int]:
    """The hashes with each block after its parent (a pool evicts a request's tail first)."""
    present = set(stored)
    children: dict[int, list[int]] = {}
    roots = []
    for h in stored:
        origin = origins.get(h)
        parent = origin.parent if origin is not None else None
        if parent in present and parent != h:
            children.setdefault(parent, []).append(h)
        else:
            roots.append(h)
    out = []
    for root in roots:
        stack = [root]
        while stack:
            h = stack.pop()
            out.append(h)
            stack.extend(reversed(children.get(h, ())))
    return out


def _stored(run: list[tuple[int, BlockOrigin]], model_id: str, block_size: int,
            medium: str) -> BlockStored:
    first = run[0][1]
    tokens: list[int] = []
    for _, origin in run:
        tokens.extend(origin.token_ids)
    salt = first.namespace[len(model_id) + 1:] if first.namespace != model_id else None
    extra = [(salt,)] + [None] * (len(run) - 1) if salt and first.parent is None else None
    return BlockStored([h for h, _ in run], first.parent, tokens, block_size, None, medium, None,
                       extra_keys=extra)


async def publish_forever(state: ServerState, config: KVEventsConfig) -> None:
    """Wait for the engine, then publish its cache's changes until cancelled."""
    while state.engine is None:
        if state.phase in ("failed", "stopped"):
            return
        await asyncio.sleep(0.1)
    engine = state.engine
    pool: BlockPool = engine.engine.pool
    pool.keep_origins = True
    engine_config = engine.engine.config
    medium = pool_medium(engine_config.device)
    tier = (tier_medium(engine_config.device, engine_config.kv_offload_size_gb > 0)
            if pool.tier else None)
    publisher = await asyncio.to_thread(ZmqEventPublisher, config)
    last = pool.event_seq
    try:
        while True:
            await engine.wait_kv_events(last, timeout=1.0)
            events = pool.events_since(last)
            if events is None:  # fell behind the pool's event log: say so, start over
                logger.warning("KV event publisher fell behind the event log; publishing a clear")
                last = pool.event_seq
                publisher.publish(KVEventBatch(time.time(), [AllBlocksCleared()]))
                continue
            for event in events:
                publisher.publish(to_batch(event, engine.model_id, engine.block_size, medium,
                                           tier))
                last = event.seq
    finally:
        await asyncio.to_thread(publisher.shutdown)
