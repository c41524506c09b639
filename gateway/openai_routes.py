"""The API surface of the gateway (OpenAI's, and Anthropic's Messages API): validate at the edge
(before any replica is touched), authenticate, tokenise as the engine will, rate-limit, hash,
then forward."""

from __future__ import annotations

import time

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from gateway import disagg
from gateway.admission import COUNT_TOKENS_PATH, admit, count_tokens
from gateway.state import GatewayState
from protocol.anthropic import CountTokensResponse
from protocol.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, unless_disconnected
from protocol.errors import model_not_found
from protocol.model_list import ModelCard, ModelList

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, "/v1/chat/completions")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, "/v1/completions")


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    return await _serve(request, "/v1/responses")


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    return await _serve(request, "/v1/messages")


@router.post(COUNT_TOKENS_PATH)
async def messages_count_tokens(request: Request) -> CountTokensResponse:
    state: GatewayState = request.app.state.gateway
    await state.keys.user(request)
    return await count_tokens(state, await request.body())


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state: GatewayState = request.app.state.gateway
    await state.keys.user(request)
    return ModelList(data=[ModelCard.model_validate(card) for card in state.model_cards()])


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> ModelCard:
    state: GatewayState = request.app.state.gateway
    await state.keys.user(request)
    card = next((c for c in state.model_cards() if c["id"] == model), None)
    if card is None:
        raise model_not_found(model)
    return ModelCard.model_validate(card)


async def _serve(request: Request, path: str) -> Response:
    started = time.perf_counter()
    state: GatewayState = request.app.state.gateway
    key = await state.keys.user(request)
    routed = await admit(state, key, await request.body(), path, request.headers, started)
    try:
        return await unless_disconnected(request, disagg.serve(state, routed))
    except ClientDisconnected:  # forward was cancelled: its booking released, upstream closed
        return Response(status_code=CLIENT_CLOSED_REQUEST)
