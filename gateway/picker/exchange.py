"""One HTTP request as the endpoint picker sees it, phase by phase over its ext_proc stream:
request headers (authenticate, learn the path and the subset hint), the buffered request body
(admit and route exactly as the gateway does, book the replica, and name the next best ones
for the proxy's retries), response headers and body (which replica answered after retries,
its status, time to first byte, usage with cached tokens: from a kvgate replica's headers, and
then the proxy is asked for none of the body; from the body's usage otherwise), then the end of
the stream, which releases the booking whether the response ended or the client went away."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from gateway.admission import COUNT_TOKENS_PATH, ENDPOINTS, admit, count_tokens
from gateway.config import ApiKey
from gateway.forward import (REPLICA_HEADER, RoutedRequest, _exclusions, _finish_request,
                             _keep_lease, _note_failure, _observe_usage, _record, _release)
from gateway.picker import flow, gie
from gateway.picker.endpoints import Endpoints, UnresolvableReplica
from gateway.replicas import Replica
from gateway.state import GatewayState
from gateway.stats import DecisionRecord
from gateway.upstream import Usage, UsageScanner, usage_of
from protocol.disconnect import CLIENT_CLOSED_REQUEST
from protocol.errors import APIError, bad_request, model_not_found, not_found
from protocol.http import api_key_of
from protocol.model_list import ModelCard, ModelList
from protocol.usage_headers import usage_from_headers
from routing.policies import Decision

MAX_USAGE_BODY_BYTES = 8 << 20  # a non-streamed answer larger than this is not read for usage
MAX_FALLBACKS = 3  # endpoints named after the chosen one, for the proxy's retries
QUEUE_ANSWER_MARGIN_S = 10.0  # past the longest queue wait, for routing once a replica frees


@dataclass(slots=True)
class Picked:
    """A routed request from its pick to the end of its response."""
    routed: RoutedRequest
    replica: Replica
    decision: Decision
    record: DecisionRecord
    lease: asyncio.Task | None
    endpoint: str = ""  # the replica's "ip:port"
    status: int | None = None
    first_byte: bool = False


Send = Callable[[ext_proc.ProcessingResponse], Awaitable[None]]  # a message to the proxy, now


class Exchange:
    def __init__(self, state: GatewayState, endpoints: Endpoints, send: Send | None = None) -> None:
        self.state, self.endpoints = state, endpoints
        self.started = time.perf_counter()
        self.headers: dict[str, str] = {}
        self.path = ""
        self.key: ApiKey | None = None
        self.subset: set[str] | None = None
        self.response_body_seen = True  # False: the proxy sends no response body (mode NONE)
        self.picked: Picked | None = None
        self.finished = False
        self._scanner = UsageScanner()
        self._header_usage: Usage | None = None  # a kvgate replica's, from its response headers
        # a message sent to the proxy before the phase's answer (a longer wait for it, queued)
        self._send = send
        self._interim: asyncio.Future | None = None
        self._body = bytearray()

    async def handle(self, request: ext_proc.ProcessingRequest) -> ext_proc.ProcessingResponse:
        if request.HasField("protocol_config"):
            self.response_body_seen = (request.protocol_config.response_body_mode
                                       != ProcessingMode.NONE)
        phase = request.WhichOneof("request")
        try:
            if phase == "response_body":  # first: one message per chunk of a streamed answer
                return await self._response_body(request.response_body)
            if phase == "request_headers":
                return await self._request_headers(request)
            if phase == "request_body":
                answer = await self._request_body(request.request_body)
            elif phase == "response_headers":
                return await self._response_headers(request.response_headers)
            else:
                return ext_proc.ProcessingResponse(**{phase: ext_proc.TrailersResponse()})
        except APIError as error:
            answer = gie.error_response(error, self.path)
        await self._interim_sent()  # a queued request's "wait longer" goes before its answer
        return answer

    # -- request ---------------------------------------------------------------------------
    async def _request_headers(self, request: ext_proc.ProcessingRequest) -> ext_proc.ProcessingResponse:
        self.headers = gie.header_map(request.request_headers)
        try:
            self.subset = gie.subset_hint(request)
        except gie.BadSubsetHint as exc:
            raise APIError(500, f"The proxy sent a malformed endpoint subset: {exc}.",
                           "server_error", None, "bad_subset_hint") from None
        self.path = self.headers.get(":path", "").split("?", 1)[0]
        method = self.headers.get(":method", "")
        self.key = await self.state.keys.user_token(api_key_of(self.headers))
        if (self.path in ENDPOINTS or self.path == COUNT_TOKENS_PATH) and method == "POST":
            if request.request_headers.end_of_stream:
                raise bad_request("The request body is empty; send a JSON object.")
            # A destination the client names itself is never used: only the picker's counts.
            return gie.continue_headers("request_headers", remove=[gie.DESTINATION_HEADER])
        if method == "GET" and self.path == "/v1/models":
            listing = ModelList(data=[ModelCard.model_validate(c) for c in self.state.model_cards()])
            return gie.immediate(200, listing.model_dump_json().encode())
        if method == "GET" and self.path.startswith("/v1/models/"):
            model = self.path.removeprefix("/v1/models/")
            card = next((c for c in self.state.model_cards() if c["id"] == model), None)
            if card is None:
                raise model_not_found(model)
            return gie.immediate(200, ModelCard.model_validate(card).model_dump_json().encode())
        raise not_found(f"Unknown request URL: {method} {self.path}.")

    async def _request_body(self, body: ext_proc.HttpBody) -> ext_proc.ProcessingResponse:
        if not body.end_of_stream:
            raise APIError(500, "The endpoint picker needs the whole request body "
                                "(request_body_mode: BUFFERED).", "server_error", None,
                           "picker_misconfigured")
        if self.path == COUNT_TOKENS_PATH:  # answered here, as the gateway does
            counted = await count_tokens(self.state, body.body)
            return gie.immediate(200, counted.model_dump_json().encode())
        routed = await admit(self.state, self.key, body.body, self.path, self.headers, self.started)
        picked = await self._pick(routed)
        excluded = await self._excluded(routed)
        picked.endpoint = await self.endpoints.of(picked.replica.url)
        endpoints = [picked.endpoint, *self._fallbacks(picked.decision, excluded)]
        changed = routed.body is not body.body and routed.body != body.body
        headers = {"x-request-id": routed.request_id}
        if changed:
            headers["content-length"] = str(len(routed.body))
        return gie.route_to(endpoints, headers, routed.body if changed else None)

    def _fallbacks(self, decision: Decision, excluded: set[str]) -> list[str]:
        """The replicas the proxy retries on, best first by the policy's own scores: those it
        could have chosen, with their addresses known (resolved by `_excluded`)."""
        candidates = [s for s in decision.scores if s.replica != decision.replica
                      and s.excluded is None and s.replica not in excluded]
        candidates.sort(key=lambda s: (s.cost is None, s.cost or 0.0, s.in_flight))
        found = (self.endpoints.known(self.state.replicas[s.replica].url) for s in candidates)
        return [e for e in found if e is not None][:MAX_FALLBACKS]

    async def _excluded(self, routed: RoutedRequest) -> set[str]:
        """Replicas the policy may not pick: the gateway's exclusions, those outside the
        proxy's subset hint, and those whose address cannot be found."""
        state = self.state
        excluded = _exclusions(state, routed.model, set(), routed.features)
        for replica in state.serving(routed.model):
            if replica.name in excluded:
                continue
            try:
                endpoint = await self.endpoints.of(replica.url)
            except UnresolvableReplica:
                excluded.add(replica.name)
                continue
            if self.subset is not None and endpoint not in self.subset:
                excluded.add(replica.name)
        return excluded

    async def _pick(self, routed: RoutedRequest, excluded: set[str] | None = None,
                    attempt: int = 1) -> Picked:
        """Book the request on a replica: the first time on one with room, waiting for one in
        the overload queue if need be; later (the proxy retried elsewhere) where it was served."""
        state = self.state
        if attempt == 1:
            decision = await flow.route_with_room(state, routed, lambda: self._excluded(routed),
                                                  self._queued)
        else:
            decision = await flow.route(state, routed, excluded or set(),
                                        f"{routed.request_id}-{attempt}")
        replica = state.replicas[decision.replica]
        replica.breaker.on_dispatch()
        record = _record(routed, decision, attempt)
        state.stats.record_decision(record)
        if attempt == 1:
            state.priorities.record_request(routed.priority)
        state.metrics.decisions.labels(decision.policy, decision.reason.split(":")[0]).inc()
        self.picked = Picked(routed, replica, decision, record, _keep_lease(state, decision))
        return self.picked

    def _queued(self, max_wait_s: float) -> None:
        """The request waits for room: the proxy is asked to wait for the answer that long (the
        message goes now; the answer, written after it, when a replica has room)."""
        if self._send is not None:
            self._interim = asyncio.ensure_future(
                self._send(gie.extend_timeout(max_wait_s + QUEUE_ANSWER_MARGIN_S)))

    async def _interim_sent(self) -> None:
        """The interim message, if any, is written before the answer that follows it."""
        interim, self._interim = self._interim, None
        if interim is not None:
            await interim

    async def _served_by(self, endpoint: str) -> None:
        """The proxy retried: the chosen replica refused (503) or could not be reached, and the
        replica at `endpoint` answered. The booking moves there, as the request's next decision
        (unless that replica is not routable now: then the books stay as they were)."""
        picked = self.picked
        served = next((r for r in self.state.serving(picked.routed.model)
                       if self.endpoints.known(r.url) == endpoint), None)
        others = {name for name in self.state.replicas if served is None or name != served.name}
        if served is None or served.name in await self._excluded(picked.routed):
            return
        picked.record.status = 503
        picked.record.error = f"{picked.replica.name} refused or was unreachable; the proxy retried on {served.name}"
        self.state.metrics.retries.labels("proxy_retry").inc()
        await _release(self.state, picked.decision, picked.lease)
        moved = await self._pick(picked.routed, others, attempt=picked.record.attempt + 1)
        moved.endpoint = endpoint

    # -- response --------------------------------------------------------------------------
    async def _response_headers(self, headers: ext_proc.HttpHeaders) -> ext_proc.ProcessingResponse:
        picked = self.picked
        if picked is None:
            return gie.continue_headers("response_headers", remove=[gie.SERVED_HEADER])
        values = gie.header_map(headers)
        served = values.get(gie.SERVED_HEADER, "")
        if served and served != picked.endpoint:
            await self._served_by(served)
            picked = self.picked
        try:
            picked.status = int(values.get(":status", "0"))
        except ValueError:
            picked.status = 502
        if picked.status >= 500 and picked.status != 503:
            _note_failure(self.state, picked.replica, picked.record, picked.status,
                          f"{picked.replica.name} answered {picked.status}")
        else:  # 503 is a refusal for load (the engine's Retry-After), not a broken replica
            picked.replica.breaker.record_success()
        usage = usage_from_headers(values) if picked.status == 200 else None
        skip_body = usage is not None and self.response_body_seen and not headers.end_of_stream
        if usage is not None:
            self._header_usage = Usage(*usage)
        if skip_body:  # nothing left to read in the body: the stream's end releases the booking
            self.response_body_seen = False
        if not self.response_body_seen or headers.end_of_stream:
            await self._first_byte()
        if headers.end_of_stream:
            await self._finish()
        answer = gie.continue_headers("response_headers", {REPLICA_HEADER: picked.replica.name},
                                      remove=[gie.SERVED_HEADER])
        return gie.without_response_body(answer) if skip_body else answer

    async def _response_body(self, body: ext_proc.HttpBody) -> ext_proc.ProcessingResponse:
        picked = self.picked
        if picked is not None and not self.finished:
            await self._first_byte()
            if picked.routed.stream:
                self._scanner.feed(body.body)
            elif len(self._body) + len(body.body) <= MAX_USAGE_BODY_BYTES:
                self._body += body.body
            if body.end_of_stream:
                await self._finish()
        return gie.continue_body("response_body")

    async def _first_byte(self) -> None:
        picked = self.picked
        if picked is None or picked.first_byte:
            return
        picked.first_byte = True
        state, routed = self.state, picked.routed
        ttft = time.perf_counter() - routed.started
        picked.record.ttft_s = ttft
        state.metrics.ttft.observe(ttft)
        state.stats.record_ttft(ttft)
        state.priorities.record_ttft(routed.priority, ttft)
        await state.shared.first_token(picked.decision.request_id)

    def _usage(self) -> Usage | None:
        if self.picked is None or self.picked.status != 200:
            return None
        if self._header_usage is not None:
            return self._header_usage
        if self.picked.routed.stream:
            return self._scanner.usage
        try:
            return usage_of(json.loads(self._body)) if self._body else None
        except ValueError:
            return None

    async def _finish(self) -> None:
        """The response ended: count it, read its usage, release the booking (once)."""
        picked = self.picked
        if picked is None or self.finished:
            return
        self.finished = True
        state = self.state
        try:
            _observe_usage(state, picked.replica, picked.record, self._usage())
            _finish_request(state, picked.routed, picked.replica, picked.record,
                            picked.status or CLIENT_CLOSED_REQUEST)
        finally:
            await _release(state, picked.decision, picked.lease)

    async def close(self) -> None:
        """The proxy closed the stream: the response ended, or the client or the replica went
        away (then the request counts as 499 unless a status came back)."""
        if self._interim is not None:  # the stream went while the request was queued
            self._interim.cancel()
            await asyncio.gather(self._interim, return_exceptions=True)
        await self._finish()
