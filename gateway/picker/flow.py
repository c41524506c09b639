"""Flow control in the endpoint picker, as the Gateway API Inference Extension's picker has it: a
request is sent only to a replica that would admit it now - one whose wait for a first token, by
the engine's own estimate (its load report plus what was booked there since), stays under the
engine's admission bound, past which it answers 503 + Retry-After. When no replica would, the
request waits in the gateway's overload queue - the same queue, bounds, order and prefix-affinity
release as the gateway's proxy - and the picker's answer to the proxy is simply sent later, once a
replica has room. A full queue or a wait past its bound ends in the gateway's own 503."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from gateway.attempts import _passed_over
from gateway.forward import RoutedRequest, _prefers, overload_error
from gateway.overload_queue import Overloaded, QueueFull, QueueTimeout
from gateway.state import GatewayState
from protocol.errors import APIError, service_unavailable
from routing.policies import Decision, NoReplicaAvailable

Exclusions = Callable[[], Awaitable[set[str]]]  # the replicas the policy may not pick, now


async def route(state: GatewayState, routed: RoutedRequest, exclude: set[str],
                request_id: str) -> Decision:
    """The policy's pick, booked; 503 when no replica may take the request at all."""
    t0 = time.perf_counter()
    try:
        decision = await state.shared.route_hashes(
            routed.hashes, routed.prompt_tokens, request_id, session_key=routed.session_key,
            exclude=exclude, priority=routed.priority)
    except NoReplicaAvailable as exc:
        raise _no_replica(state, routed, exc) from None
    state.metrics.routing_latency.observe(time.perf_counter() - t0)
    return decision


def _no_replica(state: GatewayState, routed: RoutedRequest, exc: NoReplicaAvailable) -> APIError:
    state.stats.record_request(None, ok=False)
    state.metrics.requests.labels(routed.endpoint, "none", "503").inc()
    return service_unavailable(f"No replica can take this request now: {exc}.")


async def _one_pass(state: GatewayState, routed: RoutedRequest, exclusions: Exclusions,
                    hold: bool) -> Decision | Overloaded:
    """The replicas, best first by the policy, until one would admit the request (its booking
    stays). With `hold` (a queued request), the policy's first pick over its bound ends the pass
    when it holds the prompt's prefix: the request waits for it rather than taking another."""
    tried = await exclusions()
    refusals: list[float] = []
    while True:
        t0 = time.perf_counter()
        try:
            decision = await state.shared.route_hashes(
                routed.hashes, routed.prompt_tokens, routed.request_id,
                session_key=routed.session_key, exclude=tried, priority=routed.priority)
        except NoReplicaAvailable as exc:
            if refusals:
                return Overloaded(min(refusals))
            raise _no_replica(state, routed, exc) from None
        state.metrics.routing_latency.observe(time.perf_counter() - t0)
        over = await _passed_over(state, routed, decision, tried)
        if over is None:
            return decision
        refusals.append(over)
        if hold and len(refusals) == 1 and _prefers(decision):
            return Overloaded(over, preferred=decision.replica)


async def route_with_room(state: GatewayState, routed: RoutedRequest, exclusions: Exclusions,
                          on_queued: Callable[[float], None]) -> Decision:
    """A booked pick on a replica with room, waiting in the overload queue for one if need be
    (`on_queued(longest wait in seconds)` is called as the request joins it)."""
    queue, refusal = state.overload, None
    if not len(queue):  # nobody is waiting for room: try the replicas at once
        outcome = await _one_pass(state, routed, exclusions, hold=False)
        if not isinstance(outcome, Overloaded):
            return outcome
        refusal = outcome
    on_queued(queue.max_wait_s)
    try:
        return await queue.serve(
            # a pass ends at its pick (the proxy sends the request): nothing to signal early
            routed.request_id, lambda hold, _dispatched: _one_pass(state, routed, exclusions, hold),
            refusal)
    except (QueueFull, QueueTimeout) as exc:
        raise overload_error(state, routed, exc) from None
