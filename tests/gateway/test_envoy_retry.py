"""A replica that refuses for load (503 + Retry-After) behind the real Envoy: the picker names
its choice and the next best replica, Envoy retries there, and the picker's books follow the
request to the replica that answered (its decision log shows both attempts; nothing stays
booked; the refusing replica's circuit stays closed). The refusal is one the picker cannot
foresee (a full waiting queue, not the wait for a first token it estimates)."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway import procs
from tests.gateway.envoy_procs import Envoy, Picker
from tests.gateway.test_gateway_overload import PREFIX, Busy

pytestmark = pytest.mark.timeout(240)
# one running, one waiting, then 503; no bound on the wait for a first token (which the picker
# would see coming from the replica's load reports, and route around)
REFUSING = ("--max-num-seqs", "1", "--max-waiting", "1", "--max-queue-delay-s", "0")


class Waiting(Busy):
    """A long stream that waits behind a Busy one (its thread ends once it runs)."""

    def __enter__(self) -> "Waiting":
        self.thread.start()
        return self


@pytest.fixture(scope="module")
def fleet():
    refusing, plain = procs.replica(None, *REFUSING), procs.replica()
    procs.start_all([refusing, plain])
    urls = [refusing.url, plain.url]
    picker = Picker(urls).start()
    envoy = Envoy(picker.grpc_port, urls).start()
    try:
        yield refusing, plain, picker, envoy
    finally:
        for p in (envoy, picker, refusing, plain):
            p.stop()


def chat(url: str, content: str, stream: bool = False) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": procs.MODEL, "max_tokens": 2, "stream": stream,
        "messages": [{"role": "user", "content": content}]})


def name(proc: procs.Proc) -> str:
    return proc.url.removeprefix("http://")


def test_a_refused_request_is_retried_on_the_pickers_next_endpoint(fleet):
    refusing, plain, picker, envoy = fleet
    for stream in (False, True):
        prefix = f"[{stream}] {PREFIX}"  # cached on the refusing replica only
        assert chat(refusing.url, prefix).status_code == 200
        assert procs.wait_until(lambda: chat(envoy.url, prefix + " again").headers.get(
            "x-kvgate-replica") == name(refusing), 20)
        busy, waiting = Busy(refusing.url).__enter__(), Waiting(refusing.url).__enter__()
        try:
            assert procs.wait_until(lambda: {r["name"]: r["engine_waiting"] for r in procs.admin(
                picker, "/replicas").json()["data"]}[name(refusing)] == 1, 20)
            assert chat(refusing.url, prefix + " direct").status_code == 503  # it does refuse now
            r = chat(envoy.url, prefix + " once more", stream=stream)
        finally:
            busy.__exit__()
            waiting.__exit__()
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-replica"] == name(plain)
        assert "x-kvgate-upstream" not in r.headers  # the picker's own header stays inside
        first, second = procs.admin(picker, "/decisions?limit=2").json()["data"][::-1]
        assert (first["replica"], first["status"], first["attempt"]) == (name(refusing), 503, 1)
        assert (second["replica"], second["attempt"]) == (name(plain), 2)
        assert procs.wait_until(lambda: procs.admin(picker, "/decisions?limit=1").json()
                                ["data"][0]["status"] == 200)
    rows = {r["name"]: r for r in procs.admin(picker, "/replicas").json()["data"]}
    assert rows[name(refusing)]["circuit"] == "closed"
    assert procs.wait_until(lambda: sum(r["in_flight"] for r in procs.admin(
        picker, "/replicas").json()["data"]) == 0)


def test_the_picker_names_its_choice_then_the_next_best(fleet):
    refusing, plain, picker, _ = fleet
    from tests.gateway.test_envoy_picker import _grpc_pick

    answer = _grpc_pick(picker, None)
    header = {h.header.key: h.header.raw_value.decode()
              for h in answer.request_body.response.header_mutation.set_headers}
    endpoints = header["x-gateway-destination-endpoint"].split(",")
    assert sorted(endpoints) == sorted([name(refusing), name(plain)])
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == header["x-gateway-destination-endpoint"]
