"""`GET /v1/models` and `GET /v1/models/{id}`: the names this replica answers to."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.requests import Request

from backend_engine.server.auth import require_api_key
from backend_engine.server.state import ServerState
from protocol.errors import model_not_found
from protocol.features import ALL_FEATURES
from protocol.model_list import ModelCard, ModelList

router = APIRouter(dependencies=[Depends(require_api_key)])


def _cards(state: ServerState) -> list[ModelCard]:
    engine = state.ready_engine()
    return [
        ModelCard(id=name, created=state.created, root=engine.model_id, max_model_len=engine.max_model_len,
                  features=sorted(ALL_FEATURES))
        for name in state.served_model_names
    ]


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=_cards(request.app.state.server))


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    for card in _cards(request.app.state.server):
        if card.id == model_id:
            return card
    raise model_not_found(model_id)
