"""`GET /v1/requests/{id}`: where a request this replica is serving stands — `running`,
`preempted`, `waiting` or `finished` — with its computed tokens and the seconds since a step last
advanced them. `id` is the response's `x-request-id` (its `id` field). A gateway asks it when a
stream has gone silent, to tell a busy replica from a hung one. Behind the same bearer key as
/v1/*; answered while the replica drains."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.requests import Request

from backend_engine.server.auth import require_api_key
from backend_engine.server.state import ServerState
from protocol.errors import not_found

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/requests/{request_id}")
async def request_state(request: Request, request_id: str) -> dict:
    state: ServerState = request.app.state.server
    engine_ids = state.by_response_id.get(request_id)
    progress = None
    if engine_ids and state.engine is not None:
        progress = state.engine.progress(list(engine_ids))
    if progress is None:
        raise not_found(f"No request '{request_id}' is in flight on this replica.")
    return {"id": request_id, "object": "request.state", **progress.to_dict()}
