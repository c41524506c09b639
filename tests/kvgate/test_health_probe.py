"""The launcher's health probe answers "not ready" for every way a busy child can fail to
answer, and never raises: a raised probe would abort `kvgate up` while a replica loads."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from kvgate.launcher import health
from kvgate.launcher.plan import REPLICA, ChildSpec


def _serve_once(reply: bytes, stall_s: float) -> Iterator[int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    done = threading.Event()

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(reply)
            done.wait(stall_s)  # hold the connection open without sending the rest

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        done.set()
        thread.join(5)
        server.close()


def _spec(port: int) -> ChildSpec:
    return ChildSpec(name="replica-1", role=REPLICA, argv=[], port=port)


@pytest.fixture
def stalled_503_body(monkeypatch) -> Iterator[int]:
    monkeypatch.setattr(health, "PROBE_TIMEOUT_S", 0.3)
    yield from _serve_once(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 40\r\n\r\n{", 5.0)


def test_a_503_whose_body_never_arrives_is_not_ready(stalled_503_body):
    result = health.probe(_spec(stalled_503_body))
    assert not result.healthy and result.status == "HTTP 503"


@pytest.fixture
def loading_503(monkeypatch) -> Iterator[int]:
    body = b'{"status": "loading"}'
    reply = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    yield from _serve_once(reply, 0.0)


def test_a_503_with_a_reason_shows_the_reason(loading_503):
    assert health.probe(_spec(loading_503)) == health.Probe(False, "loading")


def test_nothing_listening_is_starting():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert health.probe(_spec(port)) == health.Probe(False, "starting")
