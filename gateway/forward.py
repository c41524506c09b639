"""Route, send, and fail over: each attempt asks the policy for the best replica not yet tried;
a failure before the first byte books nothing and moves on after a jittered backoff; once bytes
have reached the client, a stream from a kvgate replica migrates to another replica (migration.py)
and any other ends with an OpenAI error event. A replica that refuses for load (503
engine_overloaded) is skipped without counting as a failure; when all refuse, the request waits
in the gateway's overload queue (overload_queue.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.responses import Response

from gateway.attempts import (Leg, RoutedRequest, _all_failed, _finish_request,  # noqa: F401
                              _first_byte, _keep_lease, _note_failure, _observe_usage,
                              _passed_over, _record, _release)
from gateway.migration import Interrupted, Migration, next_chunk
from gateway.overload_queue import Overloaded, QueueFull, QueueTimeout
from gateway.replicas import Replica, role_exclusions
from gateway.state import GatewayState
from gateway.stall_probe import silence_watch
from gateway.stats import DecisionRecord
from gateway.stream_splice import StreamSplice
from gateway.upstream import UpstreamFailure, UsageScanner, open_until_down, usage_of
from protocol.anthropic_errors import stream_error
from protocol.errors import APIError, service_unavailable
from protocol.features import RESUME
from protocol.sse import EventStreamResponse
from routing.hashing import block_hashes
from routing.policies import Decision, NoReplicaAvailable

REPLICA_HEADER = "x-kvgate-replica"


def _exclusions(state: GatewayState, model: str, tried: set[str],
                features: frozenset[str] = frozenset()) -> set[str]:
    return {name for name, r in state.replicas.items()
            if name in tried or model not in r.models or not r.routable()
            or not r.supports(features)} \
        | role_exclusions(list(state.replicas.values()), model, tried)


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
    try:
        return await state.overload.serve(
            routed.request_id,
            lambda hold, dispatched: _attempts(state, routed, tried, hold, dispatched), refusal)
    except (QueueFull, QueueTimeout) as exc:
        raise overload_error(state, routed, exc) from None


def overload_error(state: GatewayState, routed: RoutedRequest,
                   exc: QueueFull | QueueTimeout) -> APIError:
    """The overload queue's answer (full, or waited its maximum): 503 with Retry-After."""
    state.stats.record_request(None, ok=False)
    state.metrics.requests.labels(routed.endpoint, "none", "503").inc()
    state.metrics.overload_refused.labels(type(exc).__name__).inc()
    return service_unavailable(f"Every replica is at capacity and {exc}; retry later.",
                               int(max(1.0, exc.retry_after_s)), "gateway_overloaded")


async def _attempts(state: GatewayState, routed: RoutedRequest, tried: set[str] | None = None,
                    hold: bool = False, dispatched: Callable[[], None] | None = None
                    ) -> Response | Overloaded:
    opened = await _open(state, routed, tried, hold, dispatched)
    if isinstance(opened, Overloaded):
        return opened
    if routed.stream and opened.upstream.status_code == 200:
        if routed.resumable is not None and opened.replica.supports(frozenset({RESUME})) \
                and state.config.migration_limit > 0:
            return _migrating_stream(state, routed, opened)
        return _stream(state, routed, opened.replica, opened.decision, opened.record,
                       opened.upstream, opened.lease)
    return await _buffered(state, routed, opened.replica, opened.decision, opened.record,
                           opened.upstream, opened.lease)


def _upstream_for(routed: RoutedRequest, replica: Replica) -> tuple[str, bytes]:
    """The path and body a replica gets."""
    migrates = routed.resumable
    if migrates is not None and replica.supports(frozenset({RESUME})):
        # with token ids: the stream may migrate
        return migrates.path or routed.path, migrates.first_body()
    return routed.path, routed.body


def _prefers(decision: Decision) -> bool:
    """Did the policy pick the replica holding the prompt's longest cached prefix?"""
    return decision.cached_tokens > 0 and decision.cached_tokens >= max(
        s.cached_tokens for s in decision.scores)


async def _open(state: GatewayState, routed: RoutedRequest, tried: set[str] | None = None,
                hold: bool = False, dispatched: Callable[[], None] | None = None) -> Leg | Overloaded:
    """One pass over the replicas, best first, until one answers. A replica that refuses for
    load is skipped without counting as a failure; if all refuse, the request may wait. With
    `hold` (a queued request), a refusal by the policy's first pick, when that pick holds the
    prefix, ends the pass: the request waits for that replica rather than taking another.
    `dispatched` is given for a request from the overload queue: then a replica that would
    refuse by the engine's own estimate (its load report and what this gateway booked there
    since, as the Envoy picker judges it) counts as refusing without the request being sent,
    and `dispatched()` is called when it is sent, so that the queue's next request need not
    wait for this one's answer, which from a kvgate replica comes with its first token."""
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
                session_key=routed.session_key,
                exclude=_exclusions(state, routed.model, tried, routed.features),
                priority=routed.priority)
        except NoReplicaAvailable as exc:
            if last is not None or refusals:
                break
            state.stats.record_request(None, ok=False)
            state.metrics.requests.labels(routed.endpoint, "none", "503").inc()
            raise service_unavailable(f"No replica can take this request now: {exc}.") from None
        state.metrics.routing_latency.observe(time.perf_counter() - t0)
        # queued (overload established): not sent where the engine's estimate says it would refuse
        over = None if dispatched is None else await _passed_over(state, routed, decision, tried)
        if over is not None:
            refusals.append(over)
            if hold and attempt == 1 and _prefers(decision):
                return Overloaded(over, preferred=decision.replica)
            continue
        replica = state.replicas[decision.replica]
        replica.breaker.on_dispatch()
        record = _record(routed, decision, attempt)
        state.stats.record_decision(record)
        if attempt == 1:
            state.priorities.record_request(routed.priority)
        state.metrics.decisions.labels(decision.policy, decision.reason.split(":")[0]).inc()
        sent = time.perf_counter()
        lease = _keep_lease(state, decision)
        if dispatched is not None:
            dispatched()
        try:
            upstream = await open_until_down(state.proxy, replica,
                                              *_upstream_for(routed, replica), routed.headers)
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
        return Leg(replica, decision, record, upstream, lease)
    if refusals and last is None:
        return Overloaded(min(refusals))
    raise _all_failed(state, routed, last)


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
        notice = replica.watch_stream(frozenset({"down"}))  # a drain gives it its grace period
        chunks = upstream.aiter_raw()
        watch = silence_watch(state.config, state.client, replica.url, upstream)
        try:
            while (chunk := await next_chunk(chunks, notice, watch)) is not None:
                if first:
                    first = False
                    await _first_byte(state, routed, decision, record)
                scanner.feed(chunk)
                yield chunk
        except (httpx.HTTPError, Interrupted) as exc:  # not a stream that can migrate
            _note_failure(state, replica, record, 502, f"{replica.name} broke mid-stream: {exc!r}")
            state.metrics.stream_errors.labels(replica.name).inc()
            yield stream_error(APIError(502, "The replica failed while streaming; the response "
                                             "is incomplete.", "server_error", None,
                                             "upstream_error"), routed.path)
        finally:
            replica.unwatch_stream(notice)

    async def on_close() -> None:
        await upstream.aclose()
        await _release(state, decision, lease)
        _observe_usage(state, usage_replica or replica, record, scanner.usage)
        _finish_request(state, routed, replica, record, 200)

    return EventStreamResponse(relay(), headers={REPLICA_HEADER: replica.name}, on_close=on_close)


def _migrating_stream(state: GatewayState, routed: RoutedRequest, leg: Leg) -> Response:
    resumable = routed.resumable
    splice = StreamSplice(resumable.keep_token_ids, resumable.include_usage, routed.prompt_tokens)

    async def open_continuation(token_ids: list[int], tried: set[str], n: int) -> Leg | str:
        tokens = routed.prompt_token_ids + token_ids
        continuation = dataclasses.replace(
            routed, request_id=f"{routed.request_id}-m{n}", path=resumable.path or routed.path,
            body=resumable.continuation_body(token_ids),
            hashes=block_hashes(tokens, routed.namespace, state.router.block_size),
            prompt_tokens=len(tokens), features=routed.features | {RESUME}, resumable=None)
        try:
            opened = await _open(state, continuation, tried)
        except APIError as exc:
            return f"no replica could continue it ({exc})"
        if isinstance(opened, Overloaded):
            return "every replica that could continue it is at capacity"
        if opened.upstream.status_code != 200:
            await _close_leg(state, routed, opened, f"continuation answered {opened.upstream.status_code}")
            return f"its continuation was refused ({opened.upstream.status_code})"
        return opened

    async def first_byte(of: Leg) -> None:
        if of is leg:  # the client's time to first token
            await _first_byte(state, routed, leg.decision, leg.record)
        else:  # a continuation: past its prefill, as the router counts load
            await state.shared.first_token(of.decision.request_id)

    def record(cause: str, outcome: str) -> None:
        state.metrics.migrations.labels(cause, outcome).inc()
        state.stats.record_migration(cause, outcome)

    migration = Migration(splice, leg, state.config.migration_limit,
                          lambda of: silence_watch(state.config, state.client, of.replica.url,
                                                   of.upstream),
                          record, open_continuation,
                          lambda failed, why: _close_leg(state, routed, failed, why), first_byte)

    async def on_close() -> None:
        if migration.current is not None:
            final = migration.current
            await final.upstream.aclose()
            await _release(state, final.decision, final.lease)
            _observe_usage(state, final.replica, final.record,
                           None if splice.usage is None else usage_of(splice.usage))
            _finish_request(state, routed, final.replica, final.record, 200)

    events = migration.relay()
    if resumable.render is not None:  # legs of chat chunks, the client's events of another API
        events = resumable.render(events)
    return EventStreamResponse(events, headers={REPLICA_HEADER: leg.replica.name},
                               on_close=on_close)


async def _close_leg(state: GatewayState, routed: RoutedRequest, leg: Leg, why: str) -> None:
    """A leg whose replica failed mid-stream (or refused a continuation)."""
    await leg.upstream.aclose()
    await _release(state, leg.decision, leg.lease)
    _note_failure(state, leg.replica, leg.record, 502, why)
    state.metrics.stream_errors.labels(leg.replica.name).inc()
    _finish_request(state, routed, leg.replica, leg.record, 502)
