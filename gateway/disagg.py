"""Prefill/decode disaggregation at the gateway.

For a model served by decode replicas, each attempt chooses a pair (routing/policies/pd.py) and
runs the prefill half on the prefill replica - which computes the prompt, samples the first
token(s) and sends the KV blocks the decode replica lacks straight to it - then sends the decode
half, carrying those first tokens, to the decode replica and relays its answer as the client's
one ordinary OpenAI response (forward._stream / _buffered). When the decode replica already holds
nearly all of the prompt, it gets the request alone (bypass).

A failure before the first byte moves the request: a pair whose transfer failed is not paired
again, a replica that failed to answer is not used again, the next attempt takes another pair,
and when none is left the request goes to a whole-request replica through forward() (`both`
first, else a decode replica, which then prefills itself). After the first byte, a decode
replica that fails ends the stream with an OpenAI error event, as for any request."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid

import httpx
from starlette.responses import Response

from gateway.forward import RoutedRequest, _buffered, _record, _stream, forward
from gateway.pd_stats import Transfer
from gateway.replicas import Replica
from gateway.state import GatewayState
from gateway.stats import DecisionRecord
from gateway.upstream import UpstreamFailure, open_until_down
from routing.policies import NoReplicaAvailable
from routing.policies.pd import PDDecision, PDPolicy


def has_pairs(state: GatewayState, model: str) -> bool:
    return any(r.role == "decode" and r.kv_transfer_address and model in r.models and r.routable()
               for r in state.replicas.values())


async def serve(state: GatewayState, routed: RoutedRequest) -> Response:
    """The request through a prefill/decode pair when the fleet has them, else as today."""
    # /v1/responses and /v1/messages go whole: replicas take kv_transfer_params on chat and
    # completions only
    if routed.endpoint in ("responses", "messages") or not routed.single_prompt \
            or not has_pairs(state, routed.model):
        return await forward(state, routed)
    paired: set[str] = set()  # in a pair whose transfer failed: not paired again
    tried: set[str] = set()  # failed to answer: not used again for this request
    for attempt in range(1, state.config.max_attempts + 1):
        try:
            outcome = await _attempt(state, routed, attempt, paired, tried)
        except NoReplicaAvailable:
            break
        if isinstance(outcome, Response):
            return outcome
        state.metrics.retries.labels(outcome.reason).inc()
        await asyncio.sleep(state.config.retry_backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
    state.pd.fell_back()
    return await forward(state, routed, tried)


async def _attempt(state: GatewayState, routed: RoutedRequest, attempt: int, paired: set[str],
                   tried: set[str]) -> Response | UpstreamFailure:
    usable = [r for r in state.replicas.values()
              if routed.model in r.models and r.routable() and r.name not in paired | tried
              and r.supports(routed.features)]
    decode = [r.name for r in usable if r.role == "decode" and r.kv_transfer_address]
    if not decode:
        raise NoReplicaAvailable("no decode replica left")
    t0 = time.perf_counter()
    pick = state.router.route_pd(routed.hashes, routed.prompt_tokens,
                                 f"{routed.request_id}-{attempt}",
                                 [r.name for r in usable if r.role == "prefill"], decode,
                                 priority=routed.priority)
    state.metrics.routing_latency.observe(time.perf_counter() - t0)
    d = state.replicas[pick.decode.replica]
    if pick.reason == "no_prefill_replica" and any(r.role == "both" for r in usable):
        await state.shared.finish(pick.decode.request_id)  # whole requests go to `both` first
        raise NoReplicaAvailable("no prefill replica left")
    record = _decision_record(state, routed, pick, attempt)
    try:
        decode_body = routed.body
        if pick.prefill is not None:
            answer = await _prefill_half(state, routed, pick, d, record, paired, tried)
            if not isinstance(answer, dict):
                await state.shared.finish(pick.decode.request_id)
                state.router.index.unpredict(d.name, routed.hashes)  # the blocks never came
                return answer
            decode_body = _decode_body(routed.body, answer)
        d.breaker.on_dispatch()
        upstream = await open_until_down(state.proxy, d, routed.path, decode_body, routed.headers)
    except UpstreamFailure as failure:  # the decode half failed before its first byte
        await state.shared.finish(pick.decode.request_id)
        _failed(state, d, record, failure, trip=True)
        tried.add(d.name)
        return failure
    except BaseException:  # cancelled: the client left
        await state.shared.finish(pick.decode.request_id)
        raise
    d.breaker.record_success()
    usage_replica = state.replicas.get(pick.prefill.replica) if pick.prefill else None
    if routed.stream and upstream.status_code == 200:
        return _stream(state, routed, d, pick.decode, record, upstream, None, usage_replica)
    return await _buffered(state, routed, d, pick.decode, record, upstream, None, usage_replica)


def _decision_record(state: GatewayState, routed: RoutedRequest, pick: PDDecision,
                     attempt: int) -> DecisionRecord:
    record = _record(routed, pick.decode, attempt)
    record.reason = f"pd_{pick.reason}:{pick.decode.reason}"
    if pick.prefill is not None:
        prefill = _record(routed, pick.prefill, attempt)
        record.prefill_replica = pick.prefill.replica
        record.predicted_cached_tokens = pick.prefill.cached_tokens  # the prefill side's cache
        record.scores = prefill.scores + record.scores
    state.stats.record_decision(record)
    state.pd.decided(pick.reason)
    if attempt == 1:
        state.priorities.record_request(routed.priority)
    state.metrics.decisions.labels(PDPolicy.name, pick.reason).inc()
    return record


async def _prefill_half(state: GatewayState, routed: RoutedRequest, pick: PDDecision, d: Replica,
                        record: DecisionRecord, paired: set[str], tried: set[str]
                        ) -> dict | Response | UpstreamFailure:
    """The prefill replica's answer (its kv_transfer_params), the client's own error (4xx), or
    the failure that moves the request."""
    p = state.replicas[pick.prefill.replica]
    hint = pick.decode.cached_tokens // state.router.block_size
    body = _prefill_body(routed.body, uuid.uuid4().hex, d.kv_transfer_address, hint)
    p.breaker.on_dispatch()
    state.pd.started()
    t0 = time.perf_counter()
    try:
        upstream = await open_until_down(state.proxy, p, routed.path, body, routed.headers, (d,))
        try:
            content = await upstream.aread()
        finally:
            await upstream.aclose()
    except UpstreamFailure as failure:
        if _error_code(failure.body) == "kv_transfer_failed":
            paired.update((p.name, d.name))  # the pair failed, not necessarily either replica
            _failed(state, p, record, failure, trip=False, reason="kv_transfer_failed")
        elif failure.reason == "down" and failure.replica == d.name:  # the decode side died
            tried.add(d.name)
            _failed(state, d, record, failure, trip=False, reason="decode_down")
        else:
            tried.add(p.name)
            _failed(state, p, record, failure, trip=True)
        return failure
    except httpx.HTTPError as exc:  # the prefill replica broke while answering
        tried.add(p.name)
        failure = UpstreamFailure("protocol", f"{p.name} broke mid-answer: {type(exc).__name__}")
        _failed(state, p, record, failure, trip=True)
        return failure
    finally:
        state.pd.ended()
        await state.shared.finish(pick.prefill.request_id)
    if upstream.status_code != 200:  # the request itself is wrong: every replica would say so
        record.status = upstream.status_code
        state.stats.record_request(p.name, ok=upstream.status_code < 500)
        state.metrics.requests.labels(routed.endpoint, p.name, str(upstream.status_code)).inc()
        return Response(content, upstream.status_code,
                        media_type=upstream.headers.get("content-type"))
    p.breaker.record_success()
    try:
        answer = json.loads(content)["kv_transfer_params"]
        figures = answer.get("transfer") or {}
    except (ValueError, KeyError, TypeError, AttributeError):
        tried.add(p.name)
        failure = UpstreamFailure("protocol", f"{p.name} answered the prefill half without "
                                              f"kv_transfer_params")
        _failed(state, p, record, failure, trip=True)
        return failure
    state.pd.transferred(Transfer(
        time.time(), p.name, d.name, routed.prompt_tokens // state.router.block_size - hint,
        int(figures.get("blocks_needed", 0)), int(figures.get("blocks_sent", 0)),
        int(figures.get("bytes", 0)), float(figures.get("seconds", 0.0)), time.perf_counter() - t0))
    return answer


def _prefill_body(raw: bytes, transfer_id: str, address: str, hint: int) -> bytes:
    body = {k: v for k, v in json.loads(raw).items() if k != "stream_options"}
    body["stream"] = False
    body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id,
                                  "remote_address": address, "remote_cached_blocks": hint}
    return json.dumps(body, separators=(",", ":")).encode()


def _decode_body(raw: bytes, answer: dict) -> bytes:
    body = json.loads(raw)
    body["kv_transfer_params"] = {"do_remote_prefill": True,
                                  "transfer_id": answer["transfer_id"],
                                  "first_tokens": answer["first_tokens"],
                                  "cached_tokens": answer.get("cached_tokens", 0)}
    return json.dumps(body, separators=(",", ":")).encode()


def _error_code(body: bytes | None) -> str | None:
    try:
        return json.loads(body or b"")["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _failed(state: GatewayState, replica: Replica, record: DecisionRecord,
            failure: UpstreamFailure, trip: bool, reason: str | None = None) -> None:
    """Note a failure before the first byte; `trip`: it counts against the replica's circuit
    (a failed transfer does not: either side, or the network between, may be at fault; nor does
    a replica refusing for load, which is healthy, only busy)."""
    if failure.reason == "overloaded":
        replica.breaker.record_success()
        record.status, record.error = 503, str(failure)
        state.pd.failed("overloaded")
        return
    if trip:
        replica.breaker.record_failure()
    replica.counts.errors += 1
    record.status, record.error = failure.status or 502, str(failure)
    state.pd.failed(reason or failure.reason)
