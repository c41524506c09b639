"""The gateway's FastAPI app: OpenAI routes, health, metrics, admin API and dashboard."""

from __future__ import annotations

import gc
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admin_routes import api as admin_api
from gateway.admin_routes import page as admin_page
from gateway.config import GatewayConfig
from gateway.openai_routes import router as openai_router
from gateway.pin_routes import router as pin_router
from gateway.state import GatewayState
from protocol.anthropic import CountTokensRequest, MessagesRequest
from protocol.chat import ChatCompletionRequest
from protocol.completions import CompletionRequest
from protocol.http import BodySizeLimitMiddleware, install_error_handlers
from protocol.openapi import document_bodies
from protocol.responses import ResponsesRequest


def create_app(config: GatewayConfig, state: GatewayState | None = None) -> FastAPI:
    """`state`: one its owner starts and closes (the endpoint picker shares it); else the app's."""
    owned = state is None
    state = GatewayState(config) if state is None else state

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if owned:
            await state.start()
        # Everything loaded so far (modules, tokenizer, app) lives as long as the process: keep
        # it out of the collector's scans, and collect young objects less often, which trims the
        # tail latency that full collections add to requests.
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, 20, 20)
        try:
            yield
        finally:
            if owned:
                await state.close()

    app = FastAPI(title="kvgate gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=config.max_body_bytes)
    app.include_router(openai_router)
    app.include_router(admin_api)
    app.include_router(pin_router)
    app.include_router(admin_page)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        routable = [r.name for r in state.replicas.values() if r.routable()]
        body = {"status": "ok" if routable else "no_routable_replica", "routable": routable,
                "redis": state.shared.state.value}
        return JSONResponse(body, status_code=200 if routable else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render(
            replicas=state.replicas.values(), in_flight=state.in_flight_by_replica(),
            queued=len(state.overload), index=state.router.index.size(),
            pins=state.pin_store.count, redis=state.shared.state, advice=state.advice)
        return Response(body, media_type="text/plain; version=0.0.4")

    document_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                          "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest,
                          "/v1/messages/count_tokens": CountTokensRequest})
    return app
