"""Replicas that refuse for load (503 engine_overloaded + Retry-After): the gateway moves the
request to another replica without counting a failure, and when every replica refuses it waits
in the gateway's bounded overload queue and is served once a replica has room."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.gateway import procs

pytestmark = pytest.mark.timeout(240)
REFUSING = ("--max-queue-delay-s", "1e-9", "--target-itl-ms", "50")  # refuse whenever busy
PREFIX = " ".join(f"word{i}" for i in range(120))


@pytest.fixture(scope="module")
def fleet():
    refusing, plain = procs.replica(None, *REFUSING), procs.replica()
    procs.start_all([refusing, plain])
    gw = procs.gateway([refusing.url, plain.url]).start()
    lone = procs.gateway([refusing.url], "--max-queue-wait-s", "60").start()
    no_queue = procs.gateway([refusing.url], "--max-queued-requests", "0").start()
    try:
        yield refusing, plain, gw, lone, no_queue
    finally:
        for p in (gw, lone, no_queue, refusing, plain):
            p.stop()


def chat(url: str, content: str, max_tokens: int = 2, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": procs.MODEL, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}], **extra})


class Busy:
    """A long stream sent straight to a replica, so it has a running request (until closed)."""

    def __init__(self, url: str):
        self.url = url
        self.started = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": procs.MODEL, "max_tokens": 1500, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "keep busy"}]}
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                self.started.set()
                if self.stop.is_set():
                    return

    def __enter__(self) -> "Busy":
        self.thread.start()
        assert self.started.wait(60)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)


def metric(gw, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(gw.url + "/metrics").text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_a_refused_request_moves_to_another_replica_without_a_failure(fleet):
    refusing, plain, gw, _, _ = fleet
    assert chat(refusing.url, PREFIX).status_code == 200  # the prefix is cached there
    assert procs.wait_until(lambda: chat(gw.url, PREFIX + " again").headers.get(
        "x-kvgate-replica") == refusing.url.removeprefix("http://"), 20)
    with Busy(refusing.url):
        r = chat(gw.url, PREFIX + " once more")
        assert r.status_code == 200
        assert r.headers["x-kvgate-replica"] == plain.url.removeprefix("http://")
    assert metric(gw, 'kvgate_gateway_retries_total{reason="overloaded"}') >= 1
    row = next(x for x in procs.admin(gw, "/replicas").json()["data"]
               if x["url"] == refusing.url)
    assert row["circuit"] == "closed"


def test_when_every_replica_refuses_the_request_waits_and_is_served_later(fleet):
    refusing, _, _, lone, _ = fleet
    result: dict = {}

    def send() -> None:
        t0 = time.monotonic()
        result["response"] = chat(lone.url, "queued request")
        result["elapsed"] = time.monotonic() - t0

    with Busy(refusing.url):
        sender = threading.Thread(target=send)
        sender.start()
        assert procs.wait_until(
            lambda: procs.admin(lone, "/summary").json()["overload_queue"]["queued"] == 1, 20)
        time.sleep(1.5)
        assert "response" not in result  # still waiting while the replica is busy
    sender.join(60)
    assert result["response"].status_code == 200 and result["elapsed"] >= 1.5
    summary = procs.admin(lone, "/summary").json()["overload_queue"]
    assert summary["queued"] == 0 and summary["total_queued"] >= 1
    assert metric(lone, "kvgate_gateway_overload_queue_requests") == 0


def test_a_full_overload_queue_passes_the_503_on(fleet):
    refusing, _, _, _, no_queue = fleet
    with Busy(refusing.url):
        r = chat(no_queue.url, "no room")
    assert r.status_code == 503 and r.json()["error"]["code"] == "gateway_overloaded"
    assert int(r.headers["retry-after"]) >= 1
    assert metric(no_queue, 'kvgate_gateway_overload_refused_total{reason="QueueFull"}') == 1
