"""Metadata probes other routers make before routing to a worker: SGLang's `/server_info` and
`/model_info` (and their older `/get_*` names), vLLM's `/version`. They answer what this replica
is, so SGLang's model gateway (smg), vLLM's router and similar register it as a plain OpenAI
worker instead of backing off."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.requests import Request

from backend_engine.server.auth import require_api_key
from backend_engine.server.serving import _version
from backend_engine.server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)])
VERSION = _version()


def _model_info(state: ServerState) -> dict:
    engine = state.ready_engine()
    return {"model_path": engine.model_id, "tokenizer_path": engine.model_id,
            "served_model_name": state.served_model_names[0], "is_generation": True,
            "preferred_sampling_params": None, "has_image_understanding": False,
            "has_audio_understanding": False, "max_model_len": engine.max_model_len}


def _server_info(state: ServerState) -> dict:
    engine = state.ready_engine()
    load = engine.load()
    return {**_model_info(state), "engine": "kvgate", "version": VERSION,
            "page_size": engine.block_size, "context_length": engine.max_model_len,
            "max_total_num_tokens": load.get("num_total_blocks", 0) * engine.block_size,
            "tp_size": 1, "dp_size": 1, "kv_events": bool(state.settings.kv_events_config),
            "internal_states": [load]}


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict:
    return _model_info(request.app.state.server)


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict:
    return _server_info(request.app.state.server)


@router.get("/version")
async def version() -> dict:
    return {"version": VERSION}
