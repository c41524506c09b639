"""Discrete-event loop of the routing simulator: requests arrive at G gateways (each the REAL
routing.Router with the real index and policy), replicas serve them and emit KV events that reach
every gateway's index after a lag.

Shared state between gateways (what Redis provides in production: predicted entries and load
bookings, booked atomically by one Lua call) is modelled by per-gateway Routers (each with its
own policy instance: own random stream, own new-prefix rotation) sharing one PrefixIndex and
one LoadTracker; the simulator is single-threaded, so each route-and-reserve is atomic, as the
Lua script is. Unshared gateways each keep their own index (fed by every replica's events, as
in production), predicted entries and bookings, and see other gateways' load only through the
engines' lagged reports.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.sim_foreign import ZmqFeeds
from benchmarks.sim_replica import SimReplica, SimRequest
from routing.policies import make_policy
from routing.router import Router

ARRIVE, EVENT, PREFILL_DONE, FINISH = range(4)


@dataclass(slots=True)
class SimResult:
    policy: str
    gateways: int
    shared: bool
    hit_rate: float
    load_max_over_mean: float
    ttft_p50: float
    ttft_p99: float
    predicted_error_tokens: float  # mean |predicted - actual| cached tokens per request
    requests: int


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def simulate(requests: Sequence[SimRequest], policy: str, replicas: int, capacity_blocks: int,
             block_size: int = 16, gateways: int = 1, shared: bool = True,
             event_lag_s: float = 0.05, seed: int = 0, feed: str = "native",
             zmq: ZmqFeeds | None = None, approx_capacity_blocks: int | None = None) -> SimResult:
    """`feed`: "native" (kvgate's /kv/events: blocks and load), "zmq" (vLLM-format events
    through `zmq`: blocks only, no load reports) or "none" (no events: the approximate index,
    an LRU of `approx_capacity_blocks`, by default the replicas' true capacity)."""
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731 - the routers read simulated time
    sims = {f"r{i}": SimReplica(f"r{i}", capacity_blocks, block_size) for i in range(replicas)}
    routers: list[Router] = []
    for g in range(gateways):
        first = routers[0] if routers and shared else None
        router = Router(make_policy(policy, seed=seed * 100 + g), block_size=block_size,
                        clock=clock, index=first.index if first else None,
                        load=first.load if first else None)
        for name, sim in sims.items():
            if feed == "none":
                router.add_replica(name, approximate=True,
                                   capacity_blocks=approx_capacity_blocks or capacity_blocks)
                continue
            router.add_replica(name)
            router.on_snapshot(name, {"seq": 0, "block_size": block_size, "blocks": [],
                                      "load": sim.load()})
        routers.append(router)
    # Every gateway consumes every replica's event stream; shared gateways share one index.
    feeds = routers[:1] if shared else routers

    heap: list[tuple[float, int, int, object]] = []
    order = itertools.count()
    reqs = [SimRequest(r.arrival, r.hashes, r.prompt_tokens, r.output_tokens, r.session,
                       f"q{i}", token_ids=r.token_ids) for i, r in enumerate(requests)]
    for req in reqs:
        heapq.heappush(heap, (req.arrival, next(order), ARRIVE, req))

    def broadcast(name: str, event: dict, req: SimRequest | None = None) -> None:
        if feed == "none":
            return
        if feed == "zmq":
            payload = zmq.encode(name, event, req)
            for router in feeds if payload is not None else ():
                heapq.heappush(heap, (now[0] + event_lag_s, next(order), EVENT, (router, name, payload)))
            return
        for router in feeds:
            heapq.heappush(heap, (now[0] + event_lag_s, next(order), EVENT, (router, name, event)))

    def maybe_start(sim: SimReplica) -> None:
        if sim.prefilling is None and sim.queue:
            req, duration, event = sim.start_prefill()
            broadcast(sim.name, event, req)
            heapq.heappush(heap, (now[0] + duration, next(order), PREFILL_DONE, req))

    arrivals = 0
    while heap:
        now[0], _, kind, payload = heapq.heappop(heap)
        if kind == ARRIVE:
            req = payload
            req.gateway = arrivals % gateways  # an L7 balancer spreading over the gateways
            arrivals += 1
            router = routers[req.gateway]
            decision = router.route_hashes(req.hashes, req.prompt_tokens, req.request_id,
                                           session_key=req.session)
            req.replica, req.predicted_tokens = decision.replica, decision.cached_tokens
            sim = sims[req.replica]
            broadcast(sim.name, sim.enqueue(req))
            maybe_start(sim)
        elif kind == EVENT:
            router, name, event = payload
            if feed == "zmq":
                zmq.deliver(router, name, event)
            elif not router.on_event(name, event):
                sim = sims[name]  # a gap: re-read the snapshot, as a gateway would
                router.on_snapshot(name, {"seq": sim.seq, "block_size": block_size,
                                          "blocks": list(sim.cache), "load": sim.load()})
        elif kind == PREFILL_DONE:
            req = payload
            req.first_token_at = now[0]
            routers[req.gateway].first_token(req.request_id)
            sim = sims[req.replica]
            heapq.heappush(heap, (now[0] + sim.finish_prefill(req), next(order), FINISH, req))
            maybe_start(sim)
        else:
            req = payload
            req.finished_at = now[0]
            routers[req.gateway].finish(req.request_id)
            broadcast(req.replica, sims[req.replica].finish(req))

    busy = [s.busy_s for s in sims.values()]
    ttft = [r.first_token_at - r.arrival for r in reqs]
    return SimResult(
        policy=policy, gateways=gateways, shared=shared,
        hit_rate=sum(r.cached_tokens for r in reqs) / max(1, sum(r.prompt_tokens for r in reqs)),
        load_max_over_mean=max(busy) / max(1e-9, statistics.fmean(busy)),
        ttft_p50=_pct(ttft, 0.50), ttft_p99=_pct(ttft, 0.99),
        predicted_error_tokens=statistics.fmean(abs(r.predicted_tokens - r.cached_tokens)
                                                for r in reqs),
        requests=len(reqs),
    )
