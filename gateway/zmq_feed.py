"""Keeps a replica's exact prefix index current from its engine's ZMQ KV events: vLLM or SGLang
started with `--kv-events-config`, or a kvgate replica started with the same flag.

Per data-parallel rank: a SUB socket on the engine's endpoint (live batches `(topic, seq,
payload)`), a DEALER for the engine's ROUTER replay endpoint (send the first wanted seq, receive
the buffered batches and an end marker), and the SUB socket's monitor (the link to the publisher
up or down). The events are mapped to canonical hashes by `routing.engine_blocks` and land in
the same index as a kvgate replica's.

- On connect: replay from 0 (the publisher's whole buffer), so a gateway that joins late knows
  the blocks already cached; without a replay endpoint, blocks whose parents it never saw are
  dropped.
- A sequence gap asks the replay endpoint for the missed batches; if it cannot answer them all,
  that rank's entries are dropped (they may hold blocks the engine evicted since).
- The publisher gone (link down) or restarted (link down and up, or its numbers starting over):
  that rank's entries are dropped; with no rank connected the replica is routed with the
  approximate index (learned from routing history) until events flow again.
- A message that is not a KV event batch is counted and logged; the feed keeps running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.kv_events_spec import KvEventsSpec
from gateway.replicas import Replica
from protocol.kv_events import END_SEQ, BadEventBatch, BatchDecoder, KVEventBatch, seq_bytes, seq_of
from routing.engine_blocks import BlockChanges, EngineBlockMap, MapStats
from routing.event_sequence import EventSequence, Step
from routing.router import Router

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0  # silence from the replay endpoint that ends a replay
MAX_DRAIN = 512  # live messages handled per wake-up before yielding to the event loop
RCVHWM = 100_000  # live batches ZMQ queues for us while a replay runs


@dataclass(slots=True)
class FeedStats:
    batches: int = 0
    bad_messages: int = 0
    replays: int = 0
    replays_lost: int = 0  # replays that could not fill a gap: the rank's entries were dropped
    restarts: int = 0  # publishers seen starting over
    disconnects: int = 0
    connected_ranks: int = 0
    last_error: str = ""
    blocks: MapStats = field(default_factory=MapStats)

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("batches", "bad_messages", "replays", "replays_lost",
                                              "restarts", "disconnects", "connected_ranks",
                                              "last_error")}
        b = self.blocks
        out["blocks"] = {k: getattr(b, k) for k in b.__slots__}
        return out


async def follow_zmq(router: Router, replica: Replica, spec: KvEventsSpec,
                     approx_capacity_blocks: int) -> None:
    """Run until cancelled; without events the replica is routed with an approximate index of
    `approx_capacity_blocks`."""
    await ZmqFeed(router, replica, spec, approx_capacity_blocks).run()


class ZmqFeed:
    """One replica: its block map, shared by its ranks, and the switch exact <-> approximate."""

    def __init__(self, router: Router, replica: Replica, spec: KvEventsSpec,
                 approx_capacity_blocks: int) -> None:
        self.router, self.replica, self.spec = router, replica, spec
        self.approx_capacity_blocks = approx_capacity_blocks
        self.stats = FeedStats()
        self.blocks: EngineBlockMap | None = None
        self._synced: set[int] = set()
        replica.kv_source, replica.kv_feed = "zmq", self.stats

    async def run(self) -> None:
        self._fall_back()  # approximate until the first events flow
        while not self.replica.models:  # the namespace of root blocks is the served model
            await asyncio.sleep(0.2)
        self.blocks = EngineBlockMap(self.replica.models[0], self.router.block_size)
        self.stats.blocks = self.blocks.stats
        ranks = [RankFeed(self, r, endpoint, replay) for r, endpoint, replay in self.spec.ranks()]
        await asyncio.gather(*(rank.run() for rank in ranks))

    # -- called by the ranks --------------------------------------------------------------
    def apply(self, batch: KVEventBatch, rank: int, live: bool) -> None:
        self._to_index(self.blocks.apply(batch, rank))
        self.stats.batches += 1
        if live:
            self.replica.event_lag_s = max(0.0, time.time() - batch.ts)

    def clear_rank(self, rank: int) -> None:
        self._to_index(self.blocks.clear_rank(rank))

    def rank_synced(self, rank: int) -> None:
        self._synced.add(rank)
        self.stats.connected_ranks = len(self._synced)
        self.replica.kv_connected = True
        if not self.replica.exact and self._routed():
            self.router.set_approximate(self.replica.name, False)
            self.replica.exact = True
            self.router.on_blocks(self.replica.name, list(self.blocks.canonical), (),
                                  list(self.blocks.tier_canonical))
            log.info("replica %s: KV events flowing from %s; exact index", self.replica.name,
                     self.spec.endpoint)

    def rank_lost(self, rank: int) -> None:
        self._synced.discard(rank)
        self.stats.connected_ranks = len(self._synced)
        self.clear_rank(rank)
        if not self._synced:
            self._fall_back()
            log.warning("replica %s: no KV event publisher connected at %s; approximate index "
                        "until events flow again", self.replica.name, self.spec.endpoint)

    def bad_message(self, rank: int, why: str) -> None:
        self.stats.bad_messages += 1
        self.stats.last_error = why
        n = self.stats.bad_messages
        if n & (n - 1) == 0 or n % 1000 == 0:  # 1, 2, 4, 8, … then every 1000th
            log.warning("replica %s rank %d: dropped a bad KV event message (%d so far): %s",
                        self.replica.name, rank, n, why)

    # -- internals ------------------------------------------------------------------------
    def _routed(self) -> bool:
        return self.replica.name in self.router.replicas

    def _to_index(self, changes: BlockChanges) -> None:
        changed = changes.stored or changes.removed or changes.tier_stored or changes.tier_removed
        if self.replica.exact and changed and self._routed():
            self.router.on_blocks(self.replica.name, changes.stored, changes.removed,
                                  changes.tier_stored, changes.tier_removed)

    def _fall_back(self) -> None:
        self.replica.kv_connected = False
        self.replica.event_lag_s = None
        if self.replica.exact and self._routed():
            self.router.set_approximate(self.replica.name, True, self.approx_capacity_blocks)
        self.replica.exact = False


class RankFeed:
    """One data-parallel rank's stream."""

    def __init__(self, feed: ZmqFeed, rank: int, endpoint: str, replay: str | None) -> None:
        self.feed, self.rank, self.endpoint, self.replay_endpoint = feed, rank, endpoint, replay
        self.seq = EventSequence()
        self.decoder = BatchDecoder()
        self.ctx = zmq.asyncio.Context.instance()
        self._dup_until: int | None = None  # live batches up to here were covered by a replay
        self._name = f"{feed.replica.name} rank {rank}"

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.SUBSCRIBE, self.feed.spec.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await self._on_link(parse_monitor_message(await monitor.recv_multipart()))
                if sub in ready:
                    await self._drain(sub)
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    async def _on_link(self, event: dict) -> None:
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            log.info("%s: connected to %s", self._name, self.endpoint)
            if self.replay_endpoint is not None:
                start = 0 if self.seq.expected is None else self.seq.expected
                await self._replay(start)
                self._dup_until = None if self.seq.expected is None else self.seq.expected - 1
            self.feed.rank_synced(self.rank)
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            self.feed.stats.disconnects += 1
            log.warning("%s: publisher %s went away; dropping its blocks", self._name, self.endpoint)
            self.seq.reset()
            self.feed.rank_lost(self.rank)

    async def _drain(self, sub: zmq.asyncio.Socket) -> None:
        for _ in range(MAX_DRAIN):
            try:
                frames = await sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            await self._on_live(frames)

    async def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.feed.bad_message(self.rank, f"expected 3 frames (topic, seq, payload), got {len(frames)}")
            return
        try:
            seq = seq_of(frames[1])
        except BadEventBatch as exc:
            self.feed.bad_message(self.rank, str(exc))
            return
        covered = self._dup_until is not None and seq <= self._dup_until
        step = self.seq.step(seq, replaying=covered)
        if step is Step.APPLY:
            self._dup_until = None
            self._apply(seq, frames[2], live=True)
        elif step is Step.GAP:
            await self._fill_gap(seq, frames[2])
        elif step is Step.RESTART:
            self.feed.stats.restarts += 1
            log.warning("%s: sequence went back from %d to %d (publisher restarted); dropping its "
                        "blocks", self._name, self.seq.expected - 1, seq)
            self.seq.reset()
            self.feed.clear_rank(self.rank)
            if self.replay_endpoint is not None:
                await self._replay(0)
            if self.seq.step(seq, replaying=True) is Step.APPLY:
                self._apply(seq, frames[2], live=True)

    async def _fill_gap(self, seq: int, payload: bytes) -> None:
        missed = self.seq.expected
        log.info("%s: batches %d..%d missed; asking for a replay", self._name, missed, seq - 1)
        filled = self.replay_endpoint is not None and await self._replay(missed)
        if not filled or self.seq.step(seq, replaying=True) is Step.GAP:
            self.feed.stats.replays_lost += 1
            log.warning("%s: batches from %d cannot be replayed; dropping its blocks (blocks whose "
                        "parents are gone are skipped until re-stored)", self._name, missed)
            self.seq.reset()
            self.feed.clear_rank(self.rank)
        if self.seq.step(seq, replaying=True) is Step.APPLY:
            self._apply(seq, payload, live=True)
        self._dup_until = None if self.seq.expected is None else self.seq.expected - 1

    def _apply(self, seq: int, payload: bytes, live: bool) -> None:
        self.seq.applied(seq)  # a bad batch still takes its number: a replay would resend it
        try:
            batch = self.decoder.decode(payload)
        except BadEventBatch as exc:
            self.feed.bad_message(self.rank, f"batch {seq}: {exc}")
            return
        self.feed.apply(batch, self.rank, live)

    async def _replay(self, start: int) -> bool:
        """Apply the buffered batches from `start`; False if the answer did not come, or the
        buffer no longer reaches back to `start` or to what we have."""
        self.feed.stats.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", seq_bytes(start)])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                if frames and frames[0] == b"":
                    frames = frames[1:]  # the ROUTER's delimiter
                if len(frames) not in (2, 3):  # vLLM: topic, seq, payload; SGLang: seq, payload
                    self.feed.bad_message(self.rank, f"replay answer of {len(frames)} frames")
                    continue
                try:
                    seq = seq_of(frames[-2])
                except BadEventBatch as exc:
                    self.feed.bad_message(self.rank, f"replay: {exc}")
                    continue
                if seq == END_SEQ:
                    return True
                step = self.seq.step(seq, replaying=True)
                if step is Step.GAP or (step is Step.APPLY and self.seq.expected is None
                                        and start > 0 and seq > start):
                    return False
                if step is Step.APPLY:
                    self._apply(seq, frames[-1], live=False)
        except asyncio.TimeoutError:
            log.warning("%s: replay endpoint %s did not answer within %.0f s", self._name,
                        self.replay_endpoint, REPLAY_TIMEOUT_S)
            return False
        finally:
            dealer.close(0)
