"""The server's life cycle (loading → ready → draining → stopped) and its in-flight requests."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from backend_engine.errors import ModelLoadError
from protocol.errors import model_not_found, service_unavailable

if TYPE_CHECKING:
    from backend_engine.async_engine import AsyncLLMEngine
    from backend_engine.reasoning import ReasoningParser
    from backend_engine.server.settings import ServerSettings
    from backend_engine.tool_parsers import ToolParser

logger = logging.getLogger(__name__)

LOADING, READY, DRAINING, STOPPED, FAILED = "loading", "ready", "draining", "stopped", "failed"


class ServerState:
    def __init__(self, settings: "ServerSettings"):
        self.settings = settings
        self.phase = LOADING
        self.engine: "AsyncLLMEngine | None" = None
        self.failure: str | None = None
        self.created = int(time.time())
        self.in_flight: dict[str, float] = {}  # engine request id → arrival time
        # a response's id (its x-request-id header) → its engine requests (GET /v1/requests/{id})
        self.by_response_id: dict[str, list[str]] = {}
        self._response_of: dict[str, str] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.abort_in_flight = asyncio.Event()  # set when a drain's grace period is over
        self._tool_parser: "ToolParser | None" = None
        from backend_engine.reasoning import check_name

        check_name(settings.reasoning_parser)  # a bad name fails at start-up, not per request
        self.reasoning_parser: "ReasoningParser | None" = None  # set once the model is loaded

    async def load(self, engine_factory: Callable[[], "AsyncLLMEngine"]) -> None:
        """Build the engine in a worker thread (so /health answers 503 meanwhile), then start it."""
        try:
            engine = await asyncio.to_thread(engine_factory)
            await engine.start()
        except Exception as exc:  # the reason goes to the log and to /health
            if isinstance(exc, ModelLoadError):
                logger.error("model failed to load: %s", exc)
            else:
                logger.exception("model failed to load")
            self.failure = f"{type(exc).__name__}: {exc}"
            self.phase = FAILED
            return
        self.engine = engine
        self.reasoning_parser = reasoning_parser_of(self.settings.reasoning_parser, engine.tokenizer)
        if self.phase == LOADING:
            self.phase = READY
        logger.info("engine ready: model %s, max_model_len %d", engine.model_id, engine.max_model_len)

    @property
    def served_model_names(self) -> list[str]:
        if self.settings.served_model_names:
            return list(self.settings.served_model_names)
        return [self.engine.model_id] if self.engine is not None else []

    def ready_engine(self) -> "AsyncLLMEngine":
        """The engine, if new requests are accepted now; else the 503 that says why not."""
        retry = self.settings.retry_after_s
        if self.phase == READY and self.engine is not None:
            return self.engine
        if self.phase == LOADING:
            raise service_unavailable("The model is still loading; retry shortly.", retry, "model_loading")
        if self.phase in (DRAINING, STOPPED):
            raise service_unavailable("This replica is shutting down.", retry, "server_shutting_down")
        raise service_unavailable("The engine is not available.", None, "engine_unavailable")

    @property
    def tool_parser(self) -> "ToolParser":
        """The parser for this model's tool calls (--tool-call-parser, or picked by its tokenizer)."""
        if self._tool_parser is None:
            from backend_engine.tool_parsers import parser_for

            self._tool_parser = parser_for(self.settings.tool_call_parser, self.ready_engine().tokenizer)
        return self._tool_parser

    def check_model(self, model: str | None) -> str:
        """The served name to answer with; 404 model_not_found for a name we do not serve."""
        names = self.served_model_names
        if model is None or model == "":
            return names[0]
        if model not in names:
            raise model_not_found(model)
        return model

    def check_engine(self) -> None:
        """Fail the replica once its engine loop has died (e.g. a tensor-parallel rank did)."""
        dead = getattr(self.engine, "dead", None)
        if dead is not None and self.phase != FAILED:
            self.mark_dead(f"engine loop died: {dead}")

    def mark_dead(self, reason: str) -> None:
        self.failure = reason
        self.phase = FAILED

    # ---- in-flight tracking and draining ----------------------------------------------------

    def admit(self, request_id: str, response_id: str | None = None) -> None:
        self.in_flight[request_id] = time.monotonic()
        self._idle.clear()
        if response_id is not None:
            self.by_response_id.setdefault(response_id, []).append(request_id)
            self._response_of[request_id] = response_id

    def release(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)
        response_id = self._response_of.pop(request_id, None)
        if response_id is not None:
            siblings = self.by_response_id[response_id]
            siblings.remove(request_id)
            if not siblings:
                del self.by_response_id[response_id]
        if not self.in_flight:
            self._idle.set()

    async def drain(self, grace_s: float) -> None:
        """Refuse new work, let in-flight requests finish for up to `grace_s`, abort the rest."""
        if self.phase in (DRAINING, STOPPED):
            return
        self.phase = DRAINING
        logger.info("draining: %d request(s) in flight, grace %.1fs", len(self.in_flight), grace_s)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=grace_s)
        except asyncio.TimeoutError:
            logger.warning("grace period over: aborting %d request(s)", len(self.in_flight))
            self.abort_in_flight.set()  # running requests end at their next output
            if self.engine is not None:  # and queued ones, which produce none
                for request_id in list(self.in_flight):
                    await self.engine.abort(request_id)
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=5.0)
            except asyncio.TimeoutError:
                pass
        self.stop()

    def stop(self) -> None:
        self.phase = STOPPED


def reasoning_parser_of(name: str, tokenizer) -> "ReasoningParser | None":  # noqa: ANN001
    """--reasoning-parser for this model ("auto": by its chat template), logged."""
    from backend_engine.reasoning import parser_for

    template = getattr(tokenizer, "chat_template", None)
    probe = ""
    if name == "auto" and isinstance(template, str):
        try:
            probe = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                  add_generation_prompt=True, tokenize=False)
        except Exception:  # a template that needs more than one user message: no probe
            probe = ""
    parser = parser_for(name, template if isinstance(template, str) else None, probe)
    if parser is not None:
        logger.info("reasoning parser: %s", parser.name)
    return parser
