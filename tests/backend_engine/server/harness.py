"""A real replica (uvicorn + the async engine on a tiny random model) on a free loopback port,
run in a background thread, for tests and benchmarks."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from backend_engine.config import EngineConfig
from backend_engine.server.app import create_app
from backend_engine.server.settings import ServerSettings
from backend_engine.server.state import FAILED, READY, ServerState


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    state: ServerState
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def engine(self):
        return self.state.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(engine_config: EngineConfig, settings: ServerSettings | None = None,
                 timeout_s: float = 120.0) -> RunningServer:
    from backend_engine.async_engine import AsyncLLMEngine

    settings = settings or ServerSettings(log_level="warning")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings.port = port
    app = create_app(settings, lambda: AsyncLLMEngine(engine_config))
    config = uvicorn.Config(app, log_level=settings.log_level, lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    state: ServerState = app.state.server
    deadline = time.monotonic() + timeout_s
    while state.phase not in (READY, FAILED) or not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"server did not start: phase={state.phase} failure={state.failure}")
        time.sleep(0.05)
    if state.phase == FAILED:
        server.should_exit = True
        raise RuntimeError(f"engine failed to load: {state.failure}")
    return RunningServer(f"http://127.0.0.1:{port}", state, server, thread)


def wait_until(predicate, timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
