"""Pinned prefixes on this replica: `POST /admin/pins` (warm and pin), `GET /admin/pins` (pins and
pinned capacity), `DELETE /admin/pins/{pin_id}`. Behind the same bearer key as /v1/*."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Depends
from starlette.requests import Request

from backend_engine.errors import EngineError
from backend_engine.server.auth import require_api_key
from backend_engine.server.sampling import check_context_length, engine_error_to_api
from backend_engine.server.state import ServerState
from protocol.errors import not_found, service_unavailable
from protocol.parsing import parse_request
from protocol.pins import PinRequest

router = APIRouter(prefix="/admin/pins", dependencies=[Depends(require_api_key)])


def _prefix_tokens(engine, req: PinRequest) -> list[int]:  # noqa: ANN001 - AsyncLLMEngine
    """The prefix as requests will carry it: completions' encoding, or the chat template."""
    if req.token_ids is not None:
        return list(req.token_ids)
    if req.prompt is not None:
        return engine.tokenizer.encode(req.prompt, add_special_tokens=True)
    return engine.render_chat(req.template_messages(), add_generation_prompt=False,
                              chat_template_kwargs=req.chat_template_kwargs)


def _listing(state: ServerState) -> dict:
    engine = state.ready_engine()
    model = state.served_model_names[0]
    return {"data": [{**view, "model": model} for view in engine.pins()],
            "block_size": engine.block_size, **engine.pin_capacity(),
            "num_total_blocks": engine.load().get("num_total_blocks")}


@router.post("")
async def create_pin(request: Request) -> dict:
    state: ServerState = request.app.state.server
    req = parse_request(PinRequest, await request.body())
    engine = state.ready_engine()
    model = state.check_model(req.model)
    try:
        tokens = _prefix_tokens(engine, req)
        field = "prompt" if req.prompt is not None else "token_ids" if req.token_ids else "messages"
        check_context_length(len(tokens), 1, engine.max_model_len, field)
        view = await engine.pin(req.id or f"pin-{secrets.token_hex(6)}", tokens, req.cache_salt,
                                req.describe())
    except EngineError as exc:
        raise engine_error_to_api(exc) from None
    except RuntimeError as exc:  # the warm-up was aborted (drain) or the engine stopped
        raise service_unavailable(f"The prefix could not be pinned: {exc}", 1, "pin_failed") from None
    return {**view, "model": model}


@router.get("")
async def list_pins(request: Request) -> dict:
    return _listing(request.app.state.server)


@router.delete("/{pin_id}")
async def delete_pin(request: Request, pin_id: str) -> dict:
    state: ServerState = request.app.state.server
    engine = state.ready_engine()
    if not await engine.unpin(pin_id):
        raise not_found(f"No pin with id {pin_id!r} on this replica.")
    return {"id": pin_id, "deleted": True}
