"""The picker's ext_proc stream in process, over real gRPC (grpc aio server and client, no
Envoy): one answer per message in order; the usage of a streamed answer is read from its usage
chunk and the booking released at its end; a kvgate replica's usage is read from its response
headers, the proxy is asked for none of the body, and the booking goes when the stream closes; a stream the proxy resets mid-response (the client
went away) releases its booking too; a queued request's "wait longer" message comes before its
answer."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from gateway.circuit import CircuitBreaker
from gateway.config import GatewayConfig
from gateway.picker.service import EndpointPicker
from gateway.replicas import HEALTHY, Replica
from gateway.state import GatewayState
from protocol.usage_headers import CACHED_TOKENS_HEADER, PROMPT_TOKENS_HEADER, usage_headers
from tests.gateway import procs

pytestmark = pytest.mark.timeout(60)
IDLE = {"running": 0, "waiting": 0, "queue_delay_s": 0.0, "max_queue_delay_s": 10.0,
        "drain_rate_tok_s": 100.0}
FULL = {**IDLE, "running": 4, "waiting": 8, "queue_delay_s": 30.0}  # over its admission bound
USAGE = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}


def request_headers() -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in
        {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}.items()])))


def request_body(content: str) -> ext_proc.ProcessingRequest:
    body = {"model": procs.MODEL, "stream": True, "max_tokens": 2,
            "messages": [{"role": "user", "content": content}]}
    return ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(
        body=json.dumps(body).encode(), end_of_stream=True))


def response_headers(endpoint: str, extra: dict[str, str] | None = None) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in
        {":status": "200", "content-type": "text/event-stream", "x-kvgate-upstream": endpoint,
         **(extra or {})}.items()])))


def response_body(chunk: bytes, end: bool = False) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=chunk, end_of_stream=end))


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


@pytest.fixture
async def picker():
    state = GatewayState(GatewayConfig(admin_key="k", seed=0, prefix_advice=False,
                                       tokenizers={procs.MODEL: procs.tokenizer_folder()},
                                       replica_tokenizer=False))
    for port in (18001, 18002):
        replica = Replica(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}", CircuitBreaker(),
                          models=[procs.MODEL])
        replica.health = HEALTHY
        state.replicas[replica.name] = replica
        state.router.add_replica(replica.name)
        state.router.load.observe_engine(replica.name, IDLE)
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(state), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield state, ext_proc_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await server.stop(None)
        await state.close()


def booked(state: GatewayState) -> int:
    return sum(state.router.load.view(name).in_flight for name in state.replicas)


async def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def routed(stub, content: str):  # noqa: ANN001, ANN201 - (the open call, its endpoint)
    """A stream through the request phase: headers, then the body the picker routes."""
    call = stub.Process()
    await call.write(request_headers())
    await call.read()
    await call.write(request_body(content))
    return call, chosen(await call.read())


def chosen(answer: ext_proc.ProcessingResponse) -> str:
    mutation = answer.request_body.response.header_mutation.set_headers
    return next(h.header.raw_value.decode() for h in mutation
                if h.header.key == "x-gateway-destination-endpoint").split(",")[0]


async def test_streamed_answer_records_its_usage_and_releases_the_booking_at_its_end(picker):
    state, stub = picker
    call = stub.Process()
    await call.write(request_headers())
    assert (await call.read()).HasField("request_headers")
    await call.write(request_body("hello"))
    endpoint = chosen(await call.read())
    assert booked(state) == 1
    await call.write(response_headers(endpoint))
    assert (await call.read()).HasField("response_headers")
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
    await call.write(response_body(sse(chunk)))
    assert (await call.read()).HasField("response_body")
    assert booked(state) == 1  # still streaming
    await call.write(response_body(sse({**chunk, "choices": [], "usage": USAGE}) + b"data: [DONE]\n\n", end=True))
    assert (await call.read()).HasField("response_body")
    assert booked(state) == 0  # released at the end of the answer, before the stream closes
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    replica = state.replicas[endpoint]
    assert replica.counts.cached_tokens == 32 and replica.counts.prompt_tokens == 40
    assert replica.counts.requests == 1


async def test_usage_in_a_kvgate_replicas_headers_spares_the_body(picker):
    state, stub = picker
    call, endpoint = await routed(stub, "headers only")
    await call.write(response_headers(endpoint, usage_headers(40, 32)))
    answer = await call.read()
    assert answer.HasField("response_headers")
    assert answer.mode_override.response_body_mode == ProcessingMode.NONE  # no body, please
    assert booked(state) == 1  # the answer streams on
    await call.done_writing()  # the HTTP stream ended: Envoy closes the ext_proc stream
    assert await call.read() is grpc.aio.EOF
    assert await wait_for(lambda: booked(state) == 0)
    replica = state.replicas[endpoint]
    assert replica.counts.cached_tokens == 32 and replica.counts.prompt_tokens == 40
    assert state.stats.decisions[-1].ttft_s is not None


async def test_headers_without_usage_keep_the_body_coming(picker):
    state, stub = picker
    call, endpoint = await routed(stub, "a foreign replica")
    # not counts: a replica that is not kvgate's, or a proxy that mangled them
    await call.write(response_headers(endpoint, {PROMPT_TOKENS_HEADER: "40", CACHED_TOKENS_HEADER: "x"}))
    assert not (await call.read()).HasField("mode_override")
    await call.write(response_body(sse({"id": "c", "choices": [], "usage": USAGE}), end=True))
    assert (await call.read()).HasField("response_body")
    assert booked(state) == 0
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert state.replicas[endpoint].counts.cached_tokens == 32


async def test_a_stream_reset_mid_answer_releases_the_booking(picker):
    state, stub = picker
    call, endpoint = await routed(stub, "goodbye")
    await call.write(response_headers(endpoint))
    await call.read()
    assert booked(state) == 1
    call.cancel()  # the proxy resets the stream: the client went away mid-answer
    assert await wait_for(lambda: booked(state) == 0)
    assert state.replicas[endpoint].counts.requests == 1  # counted, with the status it had


async def test_a_queued_request_is_told_to_wait_before_its_answer(picker):
    state, stub = picker
    for name in state.replicas:
        state.router.load.observe_engine(name, FULL)
    call = stub.Process()
    await call.write(request_headers())
    await call.read()
    await call.write(request_body("wait for room"))
    interim = await asyncio.wait_for(call.read(), 5)
    assert interim.HasField("override_message_timeout") and not interim.HasField("request_body")
    state.router.load.observe_engine(next(iter(state.replicas)), IDLE)  # room frees
    answer = await asyncio.wait_for(call.read(), 5)
    assert chosen(answer) == next(iter(state.replicas)) and booked(state) >= 1
    call.cancel()
