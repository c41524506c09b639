"""A routed request and the bookkeeping of its attempts: the booking's lease and release, the
decision record, failures, usage and the request's end in the stats and metrics. A `Leg` is one
attempt whose replica answered: its open upstream response and what must be released with it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from gateway.resumable import Resumable
from gateway.replicas import Replica
from gateway.state import GatewayState
from gateway.stats import DecisionRecord
from gateway.upstream import UpstreamFailure
from protocol.errors import APIError, service_unavailable
from routing.policies import Decision

@dataclass(slots=True)
class RoutedRequest:
    request_id: str
    endpoint: str  # "chat" | "completions" | "responses" | "messages"
    path: str
    body: bytes
    headers: dict[str, str]
    model: str
    stream: bool
    hashes: list[int]
    prompt_tokens: int
    started: float  # perf_counter at arrival
    priority: int = 0  # effective: the request's, else its key's default
    single_prompt: bool = True  # False: a completions request with several prompts (no P/D)
    features: frozenset[str] = frozenset()  # what a replica must serve (protocol/features.py)
    prompt_token_ids: list[int] = field(default_factory=list)  # as the engine tokenises it
    namespace: str = ""  # of its block hashes
    resumable: Resumable | None = None  # a stream that may migrate (gateway/migration.py)
    session_key: str | None = None  # the client's routing hint (admission.routing_hint)


@dataclass(slots=True)
class Leg:
    """One attempt that got the replica's response headers."""
    replica: Replica
    decision: Decision
    record: DecisionRecord
    upstream: httpx.Response
    lease: asyncio.Task | None


def _keep_lease(state: GatewayState, decision: Decision) -> asyncio.Task | None:
    """Renew the request's Redis lease every third of its length while the request runs, so
    only a gateway that died leaves bookings behind, and only for one lease."""
    store = state.store
    if store is None:
        return None

    async def renew_forever() -> None:
        while True:
            await asyncio.sleep(store.lease_ms / 1000 / 3)
            await store.renew(decision.replica, decision.request_id)

    return asyncio.create_task(renew_forever())


async def _release(state: GatewayState, decision: Decision, lease: asyncio.Task | None,
                   freed: bool = True) -> None:
    if lease is not None:
        lease.cancel()
    await state.shared.finish(decision.request_id)
    if freed:
        state.overload.notify_freed(decision.replica)


async def _passed_over(state: GatewayState, routed: RoutedRequest, decision: Decision,
                       tried: set[str]) -> float | None:
    """Would the pick refuse the request, by the engine's own estimate (its load report plus
    this gateway's bookings there since)? If so, the seconds over its bound; the booking is
    released, the prefix prediction withdrawn (it would pull the next pick back there) and the
    replica joins `tried`. None: it would take the request."""
    over = state.router.load.over_admission_bound(decision.replica, routed.prompt_tokens,
                                                  decision.request_id)
    if over is None:
        return None
    await state.shared.finish(decision.request_id)
    state.router.index.unpredict(decision.replica, routed.hashes)
    tried.add(decision.replica)
    state.metrics.retries.labels("overloaded_estimate").inc()
    return over


def _record(routed: RoutedRequest, decision: Decision, attempt: int) -> DecisionRecord:
    scores = [{"replica": s.replica, "cached_tokens": s.cached_tokens, "in_flight": s.in_flight,
               "pending_prefill_tokens": s.pending_prefill_tokens, "kv_usage": s.kv_usage,
               "cost": s.cost, "excluded": s.excluded} for s in decision.scores]
    return DecisionRecord(routed.request_id, time.time(), routed.model, routed.endpoint,
                          decision.replica, decision.policy, decision.reason,
                          routed.prompt_tokens, decision.cached_tokens, scores, attempt,
                          priority=routed.priority)


def _note_failure(state: GatewayState, replica: Replica, record: DecisionRecord, status: int,
                  message: str) -> None:
    replica.breaker.record_failure()
    replica.counts.errors += 1
    record.status, record.error = status, message


def _all_failed(state: GatewayState, routed: RoutedRequest, last: UpstreamFailure | None) -> APIError:
    state.stats.record_request(None, ok=False)
    state.metrics.requests.labels(routed.endpoint, "none", "503").inc()
    detail = f" (last: {last})" if last is not None else ""
    return service_unavailable(f"Every replica tried failed before answering{detail}.",
                               code="upstream_unavailable")


def _observe_usage(state: GatewayState, replica: Replica, record: DecisionRecord, usage) -> None:
    if usage is None:
        return
    record.engine_cached_tokens = usage.cached_tokens
    predicted = record.predicted_cached_tokens
    replica.counts.prompt_tokens += usage.prompt_tokens
    replica.counts.predicted_cached_tokens += predicted
    replica.counts.cached_tokens += usage.cached_tokens
    state.stats.record_usage(replica.name, usage.prompt_tokens, predicted, usage.cached_tokens)
    m = state.metrics
    m.predicted_cached.labels(replica.name).inc(predicted)
    m.engine_cached.labels(replica.name).inc(usage.cached_tokens)
    m.prompt_tokens.labels(replica.name).inc(usage.prompt_tokens)
    # routing is judged on whole blocks: the engine may serve up to a block more from the
    # cached block continuing the prefix (partial_block.py), which no index can predict
    block = state.config.block_size
    m.prediction_error.observe(predicted - usage.cached_tokens // block * block)


def _finish_request(state: GatewayState, routed: RoutedRequest, replica: Replica,
                    record: DecisionRecord, status: int) -> None:
    record.status = status if record.status is None else record.status
    ok = record.status < 500
    replica.counts.requests += 1
    state.stats.record_request(replica.name, ok)
    state.metrics.requests.labels(routed.endpoint, replica.name, str(record.status)).inc()


async def _first_byte(state: GatewayState, routed: RoutedRequest, decision: Decision,
                      record: DecisionRecord) -> None:
    record.ttft_s = time.perf_counter() - routed.started
    state.metrics.ttft.observe(record.ttft_s)
    state.stats.record_ttft(record.ttft_s)
    state.priorities.record_ttft(routed.priority, record.ttft_s)
    await state.shared.first_token(decision.request_id)
