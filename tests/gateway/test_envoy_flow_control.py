"""Flow control in the endpoint picker, behind the real Envoy: with the one replica busy (it
admits a request only when idle), requests wait in the picker's overload queue - past Envoy's
ordinary per-message timeout, which the picker extends - and are sent one by one as it frees,
in arrival order, none refused; a wait past the queue's bound ends in the gateway's OpenAI
error; a client that leaves while queued leaves the queue, and nothing reaches the replica."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.gateway import procs
from tests.gateway.envoy_procs import Envoy, Picker
from tests.gateway.test_gateway_overload import REFUSING, Busy, metric

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    replica = procs.replica(None, *REFUSING).start()
    # strict arrival order: no request keeps to its prefix's replica (they share the template's)
    config = tmp_path_factory.mktemp("picker") / "gateway.yaml"
    config.write_text("overload_affinity_s: 0\n")
    picker = Picker([replica.url], "--config", str(config)).start()
    impatient = Picker([replica.url], "--max-queue-wait-s", "2").start()
    envoy = Envoy(picker.grpc_port, [replica.url]).start()
    short = Envoy(impatient.grpc_port, [replica.url]).start()
    try:
        yield replica, picker, impatient, envoy, short
    finally:
        for p in (short, envoy, impatient, picker, replica):
            p.stop()


def chat(envoy: Envoy, content: str, request_id: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(envoy.url + "/v1/chat/completions", timeout=timeout,
                      headers={"x-request-id": request_id},
                      json={"model": procs.MODEL, "max_tokens": 4,
                            "messages": [{"role": "user", "content": content}]})


def queue(picker: Picker) -> dict:
    return procs.admin(picker, "/summary").json()["overload_queue"]


def sees_busy(picker: Picker) -> bool:
    """The picker has the replica's report of its running request (the picker's estimate of
    the wait there is made from it)."""
    return procs.wait_until(lambda: procs.admin(picker, "/replicas").json()["data"][0]
                            ["engine_running"] >= 1, 10)


def test_queued_requests_are_served_in_order_as_the_replica_frees(fleet):
    replica, picker, _, envoy, _ = fleet
    refused_before = metric(replica, "kvgate_admission_refused")
    answers: dict[str, httpx.Response] = {}

    def send(request_id: str) -> None:
        answers[request_id] = chat(envoy, f"question {request_id}", request_id)

    ids = [f"queued-{i}" for i in range(3)]
    with Busy(replica.url):
        assert sees_busy(picker)
        threads = []
        for request_id in ids:
            threads.append(threading.Thread(target=send, args=(request_id,)))
            threads[-1].start()
            assert procs.wait_until(lambda: queue(picker)["queued"] == len(threads), 20)
        time.sleep(3.0)  # longer than Envoy's message timeout (2 s): the picker extended it
    for thread in threads:
        thread.join(120)
    assert [answers[i].status_code for i in ids] == [200] * 3, [answers[i].text for i in ids]
    served = [d["request_id"] for d in procs.admin(picker, "/decisions?limit=3").json()["data"]]
    assert served[::-1] == ids  # picked in arrival order, one as each left
    assert metric(replica, "kvgate_admission_refused") == refused_before  # none reached it to be refused
    summary = queue(picker)
    assert summary["queued"] == 0 and summary["total_queued"] >= 3 and summary["total_timed_out"] == 0
    assert procs.wait_until(lambda: all(r["in_flight"] == 0 for r in
                                        procs.admin(picker, "/replicas").json()["data"]))


def test_a_wait_past_the_queue_bound_is_an_openai_error(fleet):
    replica, _, impatient, _, short = fleet
    with Busy(replica.url):
        assert sees_busy(impatient)
        r = chat(short, "no room", "timed-out")
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "gateway_overloaded"
    assert queue(impatient)["total_timed_out"] == 1 and queue(impatient)["queued"] == 0


def test_a_client_that_leaves_while_queued_leaves_the_queue(fleet):
    replica, picker, _, envoy, _ = fleet
    outcome: list[BaseException] = []

    def leave_early() -> None:
        try:
            chat(envoy, "gone", "left-early", timeout=3.0)
        except httpx.ReadTimeout as exc:  # the client gives up while queued
            outcome.append(exc)

    with Busy(replica.url):
        assert sees_busy(picker)
        client = threading.Thread(target=leave_early)
        client.start()
        assert procs.wait_until(lambda: queue(picker)["queued"] == 1, 10)
        client.join(30)
        assert outcome, "the request should still have been waiting"
        assert procs.wait_until(lambda: queue(picker)["queued"] == 0, 10)
    assert chat(envoy, "after", "after-leaving").status_code == 200
    ids = [d["request_id"] for d in procs.admin(picker, "/decisions?limit=5").json()["data"]]
    assert "left-early" not in ids  # never routed, never booked
    assert procs.wait_until(lambda: all(r["in_flight"] == 0 for r in
                                        procs.admin(picker, "/replicas").json()["data"]))
