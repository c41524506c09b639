"""The gateway's view of this replica's prefix cache: `GET /kv/snapshot` (every cached block hash
and the event sequence number it is exact at) and `GET /kv/events?since=SEQ` (server-sent events).

Every event is one `data: {json}` line with a `type`:
- `kv`        `{type, seq, ts, stored: [hash…], removed: [hash…], cleared, load}`, seq strictly increasing
- `heartbeat` `{type, seq (last event's), ts, load}` after `kv_heartbeat_s` without events
- `resync`    `{type, seq (current), ts, load, reason}`: `since` is older than the replay buffer
              (or newer than this replica's history, e.g. after a restart); re-read the snapshot
              and reconnect with its `seq`. The stream ends after it.
The stream also ends when the replica stops or its engine dies (a dead replica exits at once
instead of holding its subscribers until uvicorn's graceful-shutdown timeout).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import APIRouter, Query
from starlette.requests import Request

from backend_engine.server.state import FAILED, STOPPED, ServerState
from protocol.sse import EventStreamResponse, sse_data
from routing.hashing import NAMESPACE_RULE

if TYPE_CHECKING:
    from backend_engine.async_engine import AsyncLLMEngine

router = APIRouter()


@router.get("/kv/snapshot")
async def kv_snapshot(request: Request) -> dict:
    state: ServerState = request.app.state.server
    engine = state.engine if state.engine is not None else state.ready_engine()
    snapshot = dict(engine.kv_snapshot())
    snapshot.setdefault("load", engine.load())
    snapshot.setdefault("namespace_rule", NAMESPACE_RULE)
    snapshot.setdefault("model", engine.model_id)  # the `model` the namespace is built from
    return snapshot


@router.get("/kv/events")
async def kv_events(request: Request, since: int | None = Query(default=None, ge=0)) -> EventStreamResponse:
    state: ServerState = request.app.state.server
    engine = state.engine if state.engine is not None else state.ready_engine()
    current = int(engine.kv_snapshot()["seq"])
    start = current if since is None else since
    return EventStreamResponse(_event_stream(state, engine, start, current))


async def _event_stream(state: ServerState, engine: AsyncLLMEngine, since: int, current: int) -> AsyncIterator[bytes]:
    heartbeat_s = state.settings.kv_heartbeat_s
    if since > current:
        yield _resync(engine, current, "since is ahead of this replica's event sequence (restarted?)")
        return
    last = since
    while state.phase not in (STOPPED, FAILED):  # a dead engine has no more events
        events = engine.kv_events_since(last)
        if events is None:
            yield _resync(engine, int(engine.kv_snapshot()["seq"]), "since is older than the replay buffer")
            return
        if events:
            load = engine.load()
            for event in events:
                payload = {"type": "kv", **event}
                payload.setdefault("load", load)
                yield sse_data(payload)
                last = int(event["seq"])
            continue
        await engine.wait_kv_events(last, timeout=heartbeat_s)
        if engine.kv_events_since(last) == []:
            yield sse_data({"type": "heartbeat", "seq": last, "ts": time.time(), "load": engine.load()})


def _resync(engine: AsyncLLMEngine, seq: int, reason: str) -> bytes:
    return sse_data({"type": "resync", "seq": seq, "ts": time.time(), "load": engine.load(), "reason": reason})
