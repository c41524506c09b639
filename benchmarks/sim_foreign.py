"""Foreign replicas for the routing simulator: each simulated engine publishes its cache changes
as vLLM does on ZMQ (msgpack `KVEventBatch`es of `BlockStored` with its OWN sha256 block hashes,
parent hash and token ids, `BlockRemoved` on eviction; no load reports), and each gateway
decodes them and maps them to canonical hashes with the real code (protocol.kv_events,
routing.engine_blocks) before they reach its index. Only the sockets are left out."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import msgspec

from benchmarks.sim_replica import SimRequest
from protocol.kv_events import BatchDecoder, BlockRemoved, BlockStored, KVEventBatch
from routing.engine_blocks import EngineBlockMap
from routing.index import PrefixIndex
from routing.router import Router


def _engine_hash(parent: bytes | None, tokens) -> bytes:  # noqa: ANN001 - an array("I") slice
    """The engine's own block hash: sha256 chained from a seed, as vLLM's default (bytes)."""
    return hashlib.sha256((parent or b"vllm-none-hash") + tokens.tobytes()).digest()


@dataclass(slots=True)
class ZmqFeeds:
    """Replica side: vLLM-format payloads; gateway side: decode + map + apply."""

    model: str
    block_size: int
    engine_of: dict[str, dict[int, bytes]] = field(default_factory=dict)  # per replica
    maps: dict[tuple[int, str], EngineBlockMap] = field(default_factory=dict)  # per (router, replica)
    decoder: BatchDecoder = field(default_factory=BatchDecoder)
    encoder: msgspec.msgpack.Encoder = field(default_factory=msgspec.msgpack.Encoder)
    payloads: list[tuple[str, bytes, int]] = field(default_factory=list)  # replica, payload, blocks

    def encode(self, replica: str, event: dict, req: SimRequest | None) -> bytes | None:
        """The batch the replica's engine publishes for this step; None if no block changed."""
        known = self.engine_of.setdefault(replica, {})
        events: list = []
        removed = [known.pop(h) for h in event["removed"] if h in known]
        if removed:
            events.append(BlockRemoved(removed, "GPU"))
        if event["stored"] and req is not None:
            events += self._stored(req, set(event["stored"]), known)
        if not events:
            return None
        payload = self.encoder.encode(KVEventBatch(time.time(), events, 0))
        self.payloads.append((replica, payload, sum(len(e.block_hashes) for e in events)))
        return payload

    def _stored(self, req: SimRequest, stored: set[int], known: dict[int, bytes]) -> list[BlockStored]:
        bs, tokens = self.block_size, req.token_ids
        out: list[BlockStored] = []
        parent: bytes | None = None
        run: list[bytes] = []
        run_start = 0
        for i, h in enumerate(req.hashes):
            engine = _engine_hash(parent, tokens[i * bs:(i + 1) * bs])
            if h in stored:
                if not run:
                    run_start, run_parent = i, parent
                run.append(engine)
                known[h] = engine
            elif run:
                out.append(self._event(run, run_parent, tokens, run_start))
                run = []
            parent = engine
        if run:
            out.append(self._event(run, run_parent, tokens, run_start))
        return out

    def _event(self, run: list[bytes], parent: bytes | None, tokens,  # noqa: ANN001
               start: int) -> BlockStored:
        bs = self.block_size
        return BlockStored(run, parent, list(tokens[start * bs:(start + len(run)) * bs]), bs,
                           None, "GPU", None)

    def deliver(self, router: Router, replica: str, payload: bytes) -> None:
        key = (id(router), replica)
        mapper = self.maps.get(key)
        if mapper is None:
            mapper = self.maps[key] = EngineBlockMap(self.model, self.block_size)
        changes = mapper.apply(self.decoder.decode(payload))
        router.on_blocks(replica, changes.stored, changes.removed)


def ingest_rate(payloads: list[tuple[str, bytes, int]], model: str, block_size: int,
                repeat: int = 3) -> float:
    """Engine blocks per second one gateway process decodes, maps and indexes: the run's
    payloads replayed in order into a fresh index (best of `repeat` passes)."""
    total = sum(n for _, _, n in payloads)
    names = sorted({name for name, _, _ in payloads})
    best = 0.0
    for _ in range(repeat):
        index = PrefixIndex(block_size)
        maps = {name: EngineBlockMap(model, block_size) for name in names}
        for name in names:
            index.add_replica(name)
        decoder = BatchDecoder()
        t0 = time.perf_counter()
        for name, payload, _ in payloads:
            changes = maps[name].apply(decoder.decode(payload))
            index.apply_blocks(name, changes.stored, changes.removed)
        best = max(best, total / (time.perf_counter() - t0))
    return best


# -- `python -m benchmarks.routing_sim --foreign` ----------------------------------------------
APPROX_CAPACITY_BLOCKS = 8192  # the gateway's default guess (GatewayConfig.approx_capacity_blocks)
ROWS = (  # label, policy, feed, gateways (several gateways share no state: no Redis)
    ("native", "prefix_cost", "native", 1), ("zmq", "prefix_cost", "zmq", 1),
    ("approximate", "prefix_cost", "none", 1), ("sglang", "sglang", "none", 1),
    ("native 2gw", "prefix_cost", "native", 2), ("zmq 2gw", "prefix_cost", "zmq", 2),
    ("approx 2gw", "prefix_cost", "none", 2),
)


def run_foreign(workloads: list, replicas: int, seed: int, block_size: int) -> dict:
    """Hit rate of the prefix-cost policy fed by native events, by vLLM-format ZMQ events and by no
    events (the approximate index, sized by the gateway's default since it cannot know a foreign
    engine's cache), and of the SGLang-style policy on its routing history; with one gateway and
    with two that share no state. Returns the summary (printed last as JSON)."""
    from benchmarks.sim_engine import simulate
    from benchmarks.sim_workloads import MODEL

    print(f"\nforeign replicas: vLLM-format KV events vs kvgate's own, {replicas} replicas, "
          f"approximate index of {APPROX_CAPACITY_BLOCKS} blocks per replica")
    print(f"{'workload':<40}{'feed':>13}{'policy':>12}{'hit':>8}{'vs native':>11}{'ttft p50':>10}")
    summary: dict = {}
    payloads: list = []
    for w in workloads:
        runs = {}
        for label, policy, feed, gateways in ROWS:
            zmq = ZmqFeeds(MODEL, block_size) if feed == "zmq" else None
            r = runs[label] = simulate(w.requests, policy, replicas, w.capacity_blocks, block_size,
                                       gateways=gateways, shared=False, seed=seed, feed=feed,
                                       zmq=zmq, approx_capacity_blocks=APPROX_CAPACITY_BLOCKS)
            if zmq is not None and not payloads:
                payloads = zmq.payloads
            base = runs["native 2gw" if gateways > 1 and "native 2gw" in runs else "native"].hit_rate
            print(f"({w.key}) {w.title[:35]:<36}{label:>13}{policy:>12}{r.hit_rate:>8.3f}"
                  f"{r.hit_rate / base if base else float('nan'):>11.3f}{r.ttft_p50 * 1000:>8.0f}ms")
        native, native2 = runs["native"].hit_rate, runs["native 2gw"].hit_rate
        summary[w.key] = {"zmq": runs["zmq"].hit_rate / native,
                          "approximate": runs["approximate"].hit_rate / native,
                          "sglang": runs["sglang"].hit_rate / native,
                          "zmq_2gw": runs["zmq 2gw"].hit_rate / native2,
                          "approximate_2gw": runs["approx 2gw"].hit_rate / native2}
    rate = ingest_rate(payloads, MODEL, block_size)
    blocks = sum(n for _, _, n in payloads)
    print(f"\ningest: {len(payloads)} batches, {blocks} engine blocks decoded, mapped and indexed "
          f"at {rate:,.0f} blocks/s (one process)")
    head = summary[workloads[0].key]
    r3 = lambda x: round(x, 3)  # noqa: E731
    return {"zmq_hit_vs_native": r3(head["zmq"]), "approximate_hit_vs_native": r3(head["approximate"]),
            "sglang_hit_vs_native": r3(head["sglang"]),
            "zmq_hit_vs_native_2gw": r3(head["zmq_2gw"]),
            "approximate_hit_vs_native_2gw": r3(head["approximate_2gw"]),
            "zmq_hit_vs_native_min": r3(min(min(v["zmq"], v["zmq_2gw"]) for v in summary.values())),
            "by_workload": {k: {m: r3(x) for m, x in v.items()} for k, v in summary.items()},
            "ingest_blocks_per_s": round(rate)}
