"""The gateway's view of the replica: snapshot and event stream name blocks with exactly the
hashes routing.hashing computes from a request's tokens."""

import asyncio
import json
import random
from types import SimpleNamespace

from backend_engine.server.kv_routes import _event_stream
from backend_engine.server.state import FAILED, READY
from routing.hashing import block_hashes, namespace_for
from tests.backend_engine.server.conftest import BLOCK_SIZE, MODEL, NUM_KV_BLOCKS


def read_events(http, since: int | None, stop=lambda e: False, max_events: int = 500) -> list[dict]:
    """Events from /kv/events until `stop(event)`, a heartbeat (caught up) or the stream ends."""
    params = {} if since is None else {"since": since}
    events = []
    with http.stream("GET", "/kv/events", params=params, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            events.append(event)
            if event["type"] == "heartbeat" or stop(event) or len(events) >= max_events:
                break
    return events


def collects(key: str, into: set[int], wanted: set[int]):
    """A stop predicate for read_events: gathers event[key] hashes until `wanted` is covered."""

    def stop(event: dict) -> bool:
        into.update(event.get(key, []))
        return wanted <= into

    return stop


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(length)]


def complete(client, prompt, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **kwargs)


def test_snapshot_shape(http):
    snap = http.get("/kv/snapshot").json()
    assert snap["block_size"] == BLOCK_SIZE and snap["namespace_rule"] == "model[|salt]"
    assert snap["model"] == MODEL and isinstance(snap["seq"], int) and isinstance(snap["blocks"], list)
    assert {"running", "waiting", "kv_usage", "pending_prefill_tokens"} <= set(snap["load"])


def test_prompt_blocks_appear_as_stored_with_routing_hashes(http, client):
    since = http.get("/kv/snapshot").json()["seq"]
    prompt = random_prompt(random.Random(1), 3 * BLOCK_SIZE + 5)
    for salt in (None, "tenant-a"):
        expected = block_hashes(prompt, namespace_for(MODEL, salt), BLOCK_SIZE)
        assert len(expected) == 3
        complete(client, prompt, extra_body={"cache_salt": salt} if salt else None)
        stored: set[int] = set()
        events = read_events(http, since, stop=collects("stored", stored, set(expected)))
        assert set(expected) <= stored, events
        kv = [e for e in events if e["type"] == "kv"]
        assert [e["seq"] for e in kv] == sorted({e["seq"] for e in kv}) and kv[0]["seq"] == since + 1
        assert all({"running", "waiting", "kv_usage"} <= set(e["load"]) for e in kv)
        assert set(expected) <= set(http.get("/kv/snapshot").json()["blocks"])
        since = kv[-1]["seq"]


def test_evicted_blocks_appear_as_removed(http, client):
    rng = random.Random(2)
    first = random_prompt(rng, 10 * BLOCK_SIZE)
    hashes = set(block_hashes(first, namespace_for(MODEL), BLOCK_SIZE))
    complete(client, first)
    since = http.get("/kv/snapshot").json()["seq"]
    assert hashes <= set(http.get("/kv/snapshot").json()["blocks"])
    for _ in range(NUM_KV_BLOCKS // 10 + 2):  # more distinct blocks than the pool holds
        complete(client, random_prompt(rng, 10 * BLOCK_SIZE))
    removed: set[int] = set()
    read_events(http, since, stop=collects("removed", removed, hashes))
    assert hashes <= removed
    assert not hashes & set(http.get("/kv/snapshot").json()["blocks"])


def test_idle_stream_sends_heartbeats_with_load(http):
    events = read_events(http, None)
    assert events[-1]["type"] == "heartbeat" and "load" in events[-1]
    assert events[-1]["seq"] == http.get("/kv/snapshot").json()["seq"]


def test_since_ahead_of_history_asks_for_resync(http):
    events = read_events(http, 10**12)
    assert [e["type"] for e in events] == ["resync"]


def test_since_older_than_replay_buffer_asks_for_resync(http, client):
    rng = random.Random(3)
    while http.get("/kv/snapshot").json()["seq"] < 70:  # the buffer keeps 64 events
        complete(client, random_prompt(rng, BLOCK_SIZE + 1))
    events = read_events(http, 0)
    assert [e["type"] for e in events] == ["resync"]
    assert events[0]["seq"] == http.get("/kv/snapshot").json()["seq"]


def test_the_event_stream_ends_when_the_engine_dies():
    """A failed replica's stream ends at once, so the process can exit (uvicorn waits for open
    streams: a subscriber used to hold a dead replica up for its graceful-shutdown timeout)."""
    class Engine:
        def kv_events_since(self, seq):
            return []

        async def wait_kv_events(self, seq, timeout):
            await asyncio.sleep(timeout)

        def load(self):
            return {}

    state = SimpleNamespace(phase=READY, settings=SimpleNamespace(kv_heartbeat_s=0.01))

    async def run() -> list[dict]:
        events = []
        async for chunk in _event_stream(state, Engine(), 0, 0):
            events.append(json.loads(chunk.decode().removeprefix("data: ")))
            if len(events) == 2:
                state.phase = FAILED
            assert len(events) < 10, "the stream outlived its engine"
        return events

    assert [e["type"] for e in asyncio.run(run())] == ["heartbeat", "heartbeat"]
