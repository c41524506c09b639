"""kvgate's routing inside Envoy: the real Envoy binary with `kvgate picker` as its ext_proc
endpoint picker in front of two tiny replicas. Requests reach the replica the picker chose, a
follow-up turn finds its prefix cached, errors keep OpenAI's format, bookings are released, and
a dead replica or a dead picker behave as configured (fail closed, or open)."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf.struct_pb2 import Struct

from tests.gateway import procs
from tests.gateway.envoy_procs import Envoy, Picker

pytestmark = pytest.mark.timeout(180)
KEY = "envoy-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster():
    replicas = [procs.replica(), procs.replica()]
    procs.start_all(replicas)
    urls = [r.url for r in replicas]
    picker = Picker(urls, "--api-key", KEY).start()
    closed, open_ = Envoy(picker.grpc_port, urls), Envoy(picker.grpc_port, urls, failure_mode_allow=True)
    closed.start(), open_.start()
    try:
        yield replicas, picker, closed, open_
    finally:
        for p in (closed, open_, picker, *replicas):
            p.stop()


def chat(envoy: Envoy, content: str, stream: bool = False, **extra) -> httpx.Response:
    body = {"model": procs.MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": content}],
            **extra}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return httpx.post(envoy.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)


def sse_events(text: str) -> list:
    frames = [f for f in text.split("\n\n") if f.strip()]
    assert all(f.startswith("data: ") for f in frames), frames
    return [f[6:] for f in frames]


def decisions(picker: Picker, n: int = 5) -> list[dict]:
    return procs.admin(picker, f"/decisions?limit={n}").json()["data"]


def in_flight(picker: Picker) -> dict[str, int]:
    return {r["name"]: r["in_flight"] for r in procs.admin(picker, "/replicas").json()["data"]}


def test_request_reaches_the_replica_the_picker_chose(cluster):
    replicas, picker, closed, _ = cluster
    r = chat(closed, procs.long_system_prompt("hotel"))
    assert r.status_code == 200, r.text
    where = r.headers["x-kvgate-replica"]
    assert where in {f"127.0.0.1:{p.port}" for p in replicas}
    last = next(d for d in decisions(picker) if d["request_id"] == r.headers["x-request-id"]
                or r.json()["id"].endswith(d["request_id"]))
    assert last["replica"] == where and last["status"] == 200
    assert r.json()["usage"]["prompt_tokens"] == last["prompt_tokens"]


def test_stream_arrives_intact_through_envoy(cluster):
    _, picker, closed, _ = cluster
    r = chat(closed, "Tell me a story.", stream=True, max_tokens=8)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert any(c["choices"] and c["choices"][0]["finish_reason"] == "length" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert len({c["id"] for c in chunks}) == 1


def test_follow_up_turn_lands_on_the_prefix_holder_with_cached_tokens(cluster):
    _, picker, closed, _ = cluster
    system = procs.long_system_prompt("india")
    first = chat(closed, system + " question 0")
    holder = first.headers["x-kvgate-replica"]
    for i, stream in ((1, False), (2, True)):
        r = chat(closed, system + f" question {i}", stream=stream)
        assert r.headers["x-kvgate-replica"] == holder
        usage = (json.loads(sse_events(r.text)[-2]) if stream else r.json())["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 192
        # the picker read the usage in the response phase: predicted == engine-reported
        assert procs.wait_until(lambda: decisions(picker, 1)[0]["engine_cached_tokens"] == cached)
        last = decisions(picker, 1)[0]
        assert last["reason"] == "cache_hit"
        assert last["predicted_cached_tokens"] == procs.whole_blocks(cached)


def ext_proc_messages(envoy: Envoy) -> int:
    """The messages Envoy has sent its ext_proc service (its admin's counter)."""
    stats = httpx.get(envoy.admin_url + "/stats?format=json&filter=ext_proc.stream_msgs_sent").json()
    return int(sum(s.get("value", 0) for s in stats["stats"]))


def test_a_kvgate_replicas_answer_reaches_the_picker_as_headers_only(cluster):
    """The usage is in a kvgate replica's response headers: the picker asks Envoy for none of
    the body, so a streamed answer costs the same three messages as a short one."""
    _, picker, closed, _ = cluster
    system = procs.long_system_prompt("juliett")
    chat(closed, system + " first")
    before = ext_proc_messages(closed)
    r = chat(closed, system + " again", stream=True, max_tokens=12)
    usage = json.loads(sse_events(r.text)[-2])["usage"]
    assert usage["completion_tokens"] == 12
    assert procs.wait_until(lambda: decisions(picker, 1)[0]["status"] == 200)
    # request headers, request body, response headers: no message per streamed chunk
    assert ext_proc_messages(closed) - before == 3
    last = decisions(picker, 1)[0]
    assert last["engine_cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert last["ttft_s"] is not None


def test_refusals_are_openai_errors(cluster):
    _, _, closed, _ = cluster
    cases = [
        (httpx.post(closed.url + "/v1/chat/completions", json={"model": procs.MODEL, "messages": []},
                    timeout=10), 401, None),
        (httpx.post(closed.url + "/v1/chat/completions", content=b"{not json", headers=AUTH,
                    timeout=10), 400, "invalid_json"),
        (httpx.post(closed.url + "/v1/chat/completions", json={"model": procs.MODEL}, headers=AUTH,
                    timeout=10), 400, None),
        (chat(closed, "hi", model="no-such-model"), 404, "model_not_found"),
        (httpx.get(closed.url + "/v1/nothing", headers=AUTH, timeout=10), 404, None),
    ]
    for r, status, code in cases:
        assert r.status_code == status, r.text
        assert r.headers["content-type"].startswith("application/json")
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if code is not None:
            assert error["code"] == code
    models = httpx.get(closed.url + "/v1/models", headers=AUTH, timeout=10)
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [procs.MODEL]


def test_messages_api_is_routed_with_anthropic_errors(cluster):
    _, picker, closed, _ = cluster
    body = {"model": procs.MODEL, "max_tokens": 2, "system": procs.long_system_prompt("juliet"),
            "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": KEY}
    first = httpx.post(closed.url + "/v1/messages", json=body, headers=headers, timeout=60)
    assert first.status_code == 200, first.text
    again = httpx.post(closed.url + "/v1/messages", json=body, headers=headers, timeout=60)
    assert again.headers["x-kvgate-replica"] == first.headers["x-kvgate-replica"]
    cached = again.json()["usage"]["cache_read_input_tokens"]
    assert cached >= 192
    assert procs.wait_until(lambda: decisions(picker, 1)[0]["engine_cached_tokens"] == cached)
    assert decisions(picker, 1)[0]["endpoint"] == "messages"
    counted = httpx.post(closed.url + "/v1/messages/count_tokens", headers=headers, timeout=10,
                         json={k: body[k] for k in ("model", "system", "messages")})
    usage = again.json()["usage"]
    assert counted.json()["input_tokens"] == usage["input_tokens"] + cached
    for r, status, kind in (
            (httpx.post(closed.url + "/v1/messages", json=body, timeout=10), 401,
             "authentication_error"),
            (httpx.post(closed.url + "/v1/messages", json={**body, "model": "nope"},
                        headers=headers, timeout=10), 404, "not_found_error")):
        assert r.status_code == status and r.json()["error"]["type"] == kind


def test_client_sent_destination_is_ignored(cluster):
    replicas, _, closed, _ = cluster
    elsewhere = f"127.0.0.1:{procs.free_port()}"  # nothing listens there
    r = httpx.post(closed.url + "/v1/chat/completions", timeout=60,
                   headers={**AUTH, "x-gateway-destination-endpoint": elsewhere},
                   json={"model": procs.MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and r.headers["x-kvgate-replica"] != elsewhere


def _grpc_pick(picker: Picker, subset: list[str] | None) -> ext_proc.ProcessingResponse:
    """Ask the picker as a GIE gateway would, with a subset hint in the filter metadata."""
    metadata = Metadata()
    if subset is not None:
        hint = Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        metadata.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    headers = ext_proc.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in
        {":method": "POST", ":path": "/v1/chat/completions", "authorization": f"Bearer {KEY}",
         "content-type": "application/json"}.items()]))
    body = json.dumps({"model": procs.MODEL, "messages": [{"role": "user", "content": "hint"}]})
    messages = [ext_proc.ProcessingRequest(request_headers=headers, metadata_context=metadata),
                ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=body.encode(),
                                                                          end_of_stream=True))]
    with grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
        answers = list(ext_proc_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))
    return answers[-1]


def test_picker_honours_the_subset_hint(cluster):
    replicas, picker, _, _ = cluster
    for replica in replicas:
        only = f"127.0.0.1:{replica.port}"
        for _ in range(3):
            answer = _grpc_pick(picker, [only])
            common = answer.request_body.response
            header = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
            assert header["x-gateway-destination-endpoint"] == only
            lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
            assert lb["x-gateway-destination-endpoint"].string_value == only
    refused = _grpc_pick(picker, [f"10.0.0.1:{replicas[0].port}"])  # outside the pool
    assert refused.immediate_response.status.code == 503
    assert json.loads(refused.immediate_response.body)["error"]["type"] == "server_error"
    # those streams ended without a response phase: their bookings are released all the same
    assert procs.wait_until(lambda: sum(in_flight(picker).values()) == 0)


def test_bookings_are_released_after_responses_and_disconnects(cluster):
    _, picker, closed, _ = cluster
    for stream in (False, True):  # answers that end: released by the end of the response
        assert chat(closed, "a short answer", stream=stream).status_code == 200
        assert procs.wait_until(lambda: sum(in_flight(picker).values()) == 0)
    body = {"model": procs.MODEL, "max_tokens": 1500, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "a long answer please"}]}
    with httpx.stream("POST", closed.url + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        chunks = r.iter_raw()  # kept: dropping the iterator would close the connection now
        next(chunks)  # the first bytes; the stream runs on while the client waits
        assert sum(in_flight(picker).values()) == 1
        assert decisions(picker, 1)[0]["ttft_s"] is not None
    # the client left mid-stream: Envoy ends the ext_proc stream and the booking goes with it
    assert procs.wait_until(lambda: sum(in_flight(picker).values()) == 0)
    assert procs.wait_until(lambda: decisions(picker, 1)[0]["status"] is not None)


def test_dead_replica_is_not_picked(cluster):
    replicas, picker, closed, _ = cluster
    dead = replicas[1]
    dead.kill()
    assert procs.wait_until(lambda: {r["name"]: r["health"] for r in procs.admin(picker, "/replicas").json()["data"]}
                            [f"127.0.0.1:{dead.port}"] == "down", timeout_s=10)
    for i in range(4):
        r = chat(closed, procs.long_system_prompt(f"kilo{i}"))
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == f"127.0.0.1:{replicas[0].port}"


def test_dead_picker_fails_closed_or_open_as_configured(cluster):
    replicas, picker, closed, open_ = cluster
    picker.kill()
    r = chat(closed, "hello")
    assert r.status_code == 503  # Envoy's own answer (status_on_error): the picker is gone
    r = chat(open_, "hello")  # fail open: Envoy's own least-request pick among the replicas
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
