"""The replica's FastAPI app: OpenAI endpoints, tokenizer endpoints, health, metrics and the KV
event surface over one AsyncLLMEngine. `create_app` takes a factory so the model loads in the
background while /health already answers 503."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI

from backend_engine.server import (chat, completions, info_routes, kv_routes, messages,
                                   model_routes, ops_routes, pin_routes, request_routes,
                                   responses, tokenize_routes, tokenizer_bundle_routes)
from backend_engine.server.kv_events_config import KVEventsConfig
from backend_engine.server.metrics import HTTPMetricsMiddleware, ServerMetrics
from backend_engine.server.settings import ServerSettings
from backend_engine.server.state import ServerState
from protocol.anthropic import CountTokensRequest, MessagesRequest
from protocol.chat import ChatCompletionRequest
from protocol.completions import CompletionRequest
from protocol.http import BodySizeLimitMiddleware, install_error_handlers
from protocol.openapi import document_bodies
from protocol.responses import ResponsesRequest
from protocol.tokenize import DetokenizeRequest, TokenizeRequest

if TYPE_CHECKING:
    from backend_engine.async_engine import AsyncLLMEngine


def _start_kv_publishing(state: ServerState) -> asyncio.Task | None:
    """The ZMQ KV event publisher's task, when `--kv-events-config` enables one."""
    text = state.settings.kv_events_config
    config = KVEventsConfig.from_json(text) if text else None
    if config is None or not config.enabled:
        return None
    from backend_engine.server.kv_zmq_events import publish_forever

    return asyncio.create_task(publish_forever(state, config))


def create_app(settings: ServerSettings, engine_factory: Callable[[], "AsyncLLMEngine"]) -> FastAPI:
    state = ServerState(settings)
    metrics = ServerMetrics(state)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(state.load(engine_factory))
        draining_metrics = asyncio.create_task(metrics.drain_forever())
        publishing = _start_kv_publishing(state)
        try:
            yield
        finally:
            if state.phase not in ("stopped", "failed"):
                state.stop()
            draining_metrics.cancel()
            if publishing is not None:
                publishing.cancel()
                await asyncio.gather(publishing, return_exceptions=True)
            await asyncio.gather(loading, return_exceptions=True)
            if state.engine is not None:
                await state.engine.shutdown()

    app = FastAPI(title="kvgate replica", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.metrics = metrics
    install_error_handlers(app)
    for module in (chat, completions, responses, messages, model_routes, tokenize_routes, ops_routes, kv_routes,
                   pin_routes, request_routes, info_routes, tokenizer_bundle_routes):
        app.include_router(module.router)
    document_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                          "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest,
                          "/v1/messages/count_tokens": CountTokensRequest,
                          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})
    # Outermost first: count every response, then refuse oversized bodies before anything reads them.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    return app
