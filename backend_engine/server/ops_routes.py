"""`GET /health` (200 ready; 503 loading, draining or failed) and `GET /metrics` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request

from backend_engine.server.state import READY, ServerState

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    state.check_engine()
    body: dict = {"status": state.phase}
    if state.failure:
        body["reason"] = state.failure
    if state.phase == READY and state.engine is not None:
        body["model"] = state.served_model_names[0]
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(state.settings.retry_after_s)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
