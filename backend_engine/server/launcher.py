"""Run the replica under uvicorn. SIGTERM (or Ctrl-C) drains: /health and new requests answer
503 at once, in-flight requests get `drain_grace_s` to finish, then the process exits. A second
signal exits immediately."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from collections.abc import Callable
from types import FrameType

import uvicorn

from backend_engine.config import EngineConfig
from backend_engine.server.app import create_app
from backend_engine.server.settings import ServerSettings
from backend_engine.server.state import FAILED, READY, ServerState

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float,
                 on_ready: Callable[[ServerState], None] | None = None):
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self.on_ready = on_ready
        self._announced = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:  # noqa: ANN001 - uvicorn's signature
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None or self.state.phase != READY:
            super().handle_exit(sig, frame)  # second signal, or nothing to drain: exit now
            return
        logger.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.state.drain(self.grace_s)
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        self.state.check_engine()  # an engine that died takes the server down: a supervisor restarts it
        if self.state.phase == FAILED and not self.should_exit:
            logger.error("exiting: %s", self.state.failure)
            self.should_exit = True
        if self.state.phase == READY and not self._announced:
            self._announced = True
            if self.on_ready is not None:
                self.on_ready(self.state)
        return await super().on_tick(counter)


def serve(settings: ServerSettings, engine_config: EngineConfig,
          on_ready: Callable[[ServerState], None] | None = None) -> int:
    """Block serving until drained or interrupted; the exit code (1 when the model failed)."""
    from backend_engine.async_engine import AsyncLLMEngine

    if engine_config.kv_transfer_host is None:  # the KV receiver listens where the server does
        engine_config = dataclasses.replace(engine_config, kv_transfer_host=settings.host)
    app = create_app(settings, lambda: AsyncLLMEngine(engine_config))
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        timeout_graceful_shutdown=max(1, int(settings.kv_heartbeat_s * 2) + 1), lifespan="on",
    )
    server = DrainingServer(config, app.state.server, settings.drain_grace_s, on_ready)
    server.run()
    return 1 if app.state.server.phase == FAILED else 0
