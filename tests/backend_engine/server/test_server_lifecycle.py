"""Loading (503 until the model is up) and SIGTERM draining (503 to new work, in-flight requests
finish, the process exits)."""

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx

from backend_engine.server.app import create_app
from backend_engine.server.settings import ServerSettings
from tests.backend_engine.server.harness import wait_until

TINY_FLAGS = ["--model", "tiny-random", "--enforce-eager", "--num-kv-blocks", "256", "--max-model-len", "512", "--log-level", "warning"]


def test_health_and_requests_are_503_while_loading():
    release = threading.Event()

    def slow_factory():
        release.wait(10)
        raise RuntimeError("model file missing")

    app = create_app(ServerSettings(), slow_factory)
    state = app.state.server  # ASGITransport runs no lifespan: drive the loading through the state
    assert state.phase == "loading"

    async def drive():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica") as c:
            loader = asyncio.ensure_future(state.load(slow_factory))
            health = await c.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "loading"
            models = await c.get("/v1/models")
            assert models.status_code == 503 and models.json()["error"]["code"] == "model_loading"
            assert "retry-after" in models.headers
            release.set()
            await loader
            health = await c.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "failed"
            assert "model file missing" in health.json()["reason"]

    asyncio.run(drive())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def replica_process(drain_grace_s: float):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "engine", "--port", str(port), "--drain-grace",
                             str(drain_grace_s), *TINY_FLAGS], env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def healthy() -> bool:
        try:
            return httpx.get(base + "/health").status_code == 200
        except httpx.TransportError:
            return False

    try:
        assert wait_until(healthy, timeout_s=90, interval_s=0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_long_stream(base: str) -> tuple[threading.Thread, list[str]]:
    """A 4 x 480-token stream in a thread; returns once its first events arrived."""
    events: list[str] = []

    def read():
        body = {"model": "tiny-random", "prompt": "drain me", "max_tokens": 480, "n": 4, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=read)
    reader.start()
    assert wait_until(lambda: len(events) > 2, timeout_s=30)
    return reader, events


def test_sigterm_drains_in_flight_requests_then_exits():
    with replica_process(drain_grace_s=20) as (proc, base):
        reader, events = start_long_stream(base)
        proc.send_signal(signal.SIGTERM)
        sent_before_sigterm = len(events)
        assert wait_until(lambda: httpx.get(base + "/health").status_code == 503, timeout_s=5)
        refused = httpx.post(base + "/v1/completions", json={"model": "tiny-random", "prompt": "hi"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert "retry-after" in refused.headers
        reader.join(timeout=60)
        assert events[-1] == "data: [DONE]" and len(events) > sent_before_sigterm + 100
        choices = [json.loads(e[6:])["choices"][0] for e in events[:-1]]
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"] * 4  # not cut off
        assert proc.wait(timeout=30) == 0


def test_requests_still_running_after_the_grace_period_are_aborted():
    with replica_process(drain_grace_s=0.3) as (proc, base):
        reader, events = start_long_stream(base)
        proc.send_signal(signal.SIGTERM)
        reader.join(timeout=30)
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "server_shutting_down"
        assert proc.wait(timeout=30) == 0
