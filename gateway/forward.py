"""Route, send, and fail over: each attempt asks the policy for the best replica not yet tried;
a failure before the first byte books nothing and moves on after a jittered backoff; once bytes
have reached the client, an upstream failure ends the stream with an OpenAI error event. A
replica that refuses for load (503 engine_overloaded) is skipped without counting as a failure;
when all refuse, the request waits in the gateway's overload queue (overload_queue.py)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from starlette.responses import Response

from gateway.overload_queue import QueueFull, QueueTimeout
from gateway.replicas import Replica, role_exclusions
from gateway.state import GatewayState
from gateway.stats import DecisionRecord
from gateway.upstream import UpstreamFailure, UsageScanner, open_until_down, usage_of
from protocol.errors import APIError, service_unavailable
from protocol.sse import DONE, EventStreamResponse, sse_error
from routing.policies import Decision, NoReplicaAvailable

REPLICA_HEADER = "x-kvgate-replica"


@dataclass(slots=True)
class RoutedRequest:
    request_id: str
    endpoint: str  # "chat" | "completions" | "responses"
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


def _exclusions(state: GatewayState, model: str, tried: set[str],
                features: frozenset[str] = frozenset()) -> set[str]:
    return {name for name, r in state.replicas.items()
            if name in tried or model not in r.models or not r.routable()
            or not r.supports(features)} \
        | role_exclusions(list(state.replicas.values()), model, tried)


@dataclass(slots=True)
class Overloaded:
    """Every replica that could take the request refused it for load (or, for a queued request
    that may hold on to its prefix, the replica holding the prefix did: `preferred`)."""
    retry_after_s: float
    preferred: str | None = None


async def forward(state: GatewayState, routed: RoutedRequest,
                  tried: set[str] | None = None) -> Response:
    """`tried`: replicas that already failed this request (a P/D attempt before this one)."""
    if not len(state.overload):  # nobody is waiting for room: try the replicas at once
        outcome = await _attempts(state, routed, tried)
        if not isinstance(outcome, Overloaded):
            return outcome
    else:
        outcome = None
    return await _forward_queued(state, routed, outcome, tried)


async def _forward_queued(state: GatewayState, routed: RoutedRequest,
                          refusal: Overloaded | None, tried: set[str] | None) -> Response:
    """Wait in the gateway's overload queue, in arrival order, and retry at its head."""
    queue = state.overload
    try:
        async with queue.holding(routed.request_id) as ticket:
            await queue.wait_turn(ticket)
            while True:
                if refusal is not None:
                    await queue.wait_retry(ticket, refusal.retry_after_s)
                outcome = await _attempts(state, routed, tried, hold=queue.may_hold(ticket))
                if not isinstance(outcome, Overloaded):
                    return outcome
                refusal = outcome
                if outcome.preferred is not None:
                    queue.hold(ticket, outcome.preferred)
    except (QueueFull, QueueTimeout) as exc:
        state.stats.record_request(None, ok=False)
        state.metrics.requests.labels(routed.endpoint, "none", "503").inc()
        state.metrics.overload_refused.labels(type(exc).__name__).inc()
        retry = int(max(1.0, refusal.retry_after_s if refusal else 1.0))
        raise service_unavailable(f"Every replica is at capacity and {exc}; retry later.",
                                  retry, "gateway_overloaded") from None


def _prefers(decision: Decision) -> bool:
    """Did the policy pick the replica holding the prompt's longest cached prefix?"""
    return decision.cached_tokens > 0 and decision.cached_tokens >= max(
        s.cached_tokens for s in decision.scores)


async def _attempts(state: GatewayState, routed: RoutedRequest, tried: set[str] | None = None,
                    hold: bool = False) -> Response | Overloaded:
    """One pass over the replicas, best first, until one answers. A replica that refuses for
    load is skipped without counting as a failure; if all refuse, the request may wait. With
    `hold` (a queued request), a refusal by the policy's first pick, when that pick holds the
    prefix, ends the pass: the request waits for that replica rather than taking another."""
    tried = set(tried or ())
    last: UpstreamFailure | None = None
    refusals: list[float] = []
    config = state.config
    failures = 0
    attempt = 0
    while failures < config.max_attempts:
        attempt += 1
        t0 = time.perf_counter()
        try:
            decision = await state.shared.route_hashes(
                routed.hashes, routed.prompt_tokens, f"{routed.request_id}-{attempt}",
                exclude=_exclusions(state, routed.model, tried, routed.features),
                priority=routed.priority)
        except NoReplicaAvailable as exc:
            if last is not None or refusals:
                break
            state.stats.record_request(None, ok=False)
            state.metrics.requests.labels(routed.endpoint, "none", "503").inc()
            raise service_unavailable(f"No replica can take this request now: {exc}.") from None
        state.metrics.routing_latency.observe(time.perf_counter() - t0)
        replica = state.replicas[decision.replica]
        replica.breaker.on_dispatch()
        record = _record(routed, decision, attempt)
        state.stats.record_decision(record)
        if attempt == 1:
            state.priorities.record_request(routed.priority)
        state.metrics.decisions.labels(decision.policy, decision.reason.split(":")[0]).inc()
        sent = time.perf_counter()
        lease = _keep_lease(state, decision)
        try:
            upstream = await open_until_down(state.proxy, replica, routed.path, routed.body,
                                              routed.headers)
        except UpstreamFailure as failure:
            # a refusal for load frees no place there: nobody queued should be woken for it
            await _release(state, decision, lease, freed=failure.reason != "overloaded")
            tried.add(replica.name)
            if failure.reason == "overloaded":  # healthy, only busy: no breaker, no backoff
                replica.breaker.record_success()
                # it took nothing: its prefix prediction would pull the next try there as well
                state.router.index.unpredict(replica.name, routed.hashes)
                record.status, record.error = 503, str(failure)
                refusals.append(failure.retry_after_s or 1.0)
                state.metrics.retries.labels("overloaded").inc()
                if hold and attempt == 1 and _prefers(decision):
                    return Overloaded(refusals[0], preferred=replica.name)
                continue
            _note_failure(state, replica, record, failure.status or 502, str(failure))
            last = failure
            failures += 1
            if failures < config.max_attempts:
                state.metrics.retries.labels(failure.reason).inc()
                await asyncio.sleep(config.retry_backoff_s * 2 ** (failures - 1)
                                    * random.uniform(0.5, 1.5))
            continue
        except BaseException:  # cancelled (the client left before the replica answered)
            await _release(state, decision, lease)
            raise
        state.metrics.upstream_latency.labels(replica.name).observe(time.perf_counter() - sent)
        replica.breaker.record_success()
        if routed.stream and upstream.status_code == 200:
            return _stream(state, routed, replica, decision, record, upstream, lease)
        return await _buffered(state, routed, replica, decision, record, upstream, lease)
    if refusals and last is None:
        return Overloaded(min(refusals))
    raise _all_failed(state, routed, last)


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
    m.prediction_error.observe(predicted - usage.cached_tokens)


def _finish_request(state: GatewayState, routed: RoutedRequest, replica: Replica,
                    record: DecisionRecord, status: int) -> None:
    record.status = status if record.status is None else record.status
    ok = record.status < 500
    replica.counts.requests += 1
    state.stats.record_request(replica.name, ok)
    state.metrics.requests.labels(routed.endpoint, replica.name, str(record.status)).inc()


async def _buffered(state: GatewayState, routed: RoutedRequest, replica: Replica,
                    decision: Decision, record: DecisionRecord,
                    upstream: httpx.Response, lease: asyncio.Task | None,
                    usage_replica: Replica | None = None) -> Response:
    """`usage_replica`: whose cache the usage's cached tokens count (a pair's prefill side)."""
    try:
        content = await upstream.aread()
    except httpx.HTTPError as exc:
        _note_failure(state, replica, record, 502, f"{replica.name} broke mid-response: {exc}")
        raise APIError(502, "The replica failed while answering.", "server_error", None,
                       "upstream_error") from None
    finally:
        await upstream.aclose()
        await _release(state, decision, lease)
        _finish_request(state, routed, replica, record, upstream.status_code)
    elapsed = time.perf_counter() - routed.started
    record.ttft_s = elapsed
    state.metrics.ttft.observe(elapsed)
    state.stats.record_ttft(elapsed)
    state.priorities.record_ttft(routed.priority, elapsed)
    if upstream.status_code == 200:
        try:
            _observe_usage(state, usage_replica or replica, record, usage_of(json.loads(content)))
        except ValueError:
            pass
    return Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"),
                    headers={REPLICA_HEADER: replica.name})


def _stream(state: GatewayState, routed: RoutedRequest, replica: Replica, decision: Decision,
            record: DecisionRecord, upstream: httpx.Response, lease: asyncio.Task | None,
            usage_replica: Replica | None = None) -> Response:
    scanner = UsageScanner()

    async def relay() -> AsyncIterator[bytes]:
        first = True
        try:
            async for chunk in upstream.aiter_raw():
                if first:
                    first = False
                    record.ttft_s = time.perf_counter() - routed.started
                    state.metrics.ttft.observe(record.ttft_s)
                    state.stats.record_ttft(record.ttft_s)
                    state.priorities.record_ttft(routed.priority, record.ttft_s)
                    await state.shared.first_token(decision.request_id)
                scanner.feed(chunk)
                yield chunk
        except httpx.HTTPError as exc:
            _note_failure(state, replica, record, 502, f"{replica.name} broke mid-stream: {exc}")
            state.metrics.stream_errors.labels(replica.name).inc()
            yield sse_error(APIError(502, "The replica failed while streaming; the response is "
                                          "incomplete.", "server_error", None, "upstream_error"))
            yield DONE

    async def on_close() -> None:
        await upstream.aclose()
        await _release(state, decision, lease)
        _observe_usage(state, usage_replica or replica, record, scanner.usage)
        _finish_request(state, routed, replica, record, 200)

    return EventStreamResponse(relay(), headers={REPLICA_HEADER: replica.name}, on_close=on_close)
