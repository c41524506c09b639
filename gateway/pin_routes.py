"""`/admin/api/pins` (admin key): list, add and remove pinned prefixes. A new pin is pushed to
every healthy replica serving its model before the answer; if every one of them refuses it (too
short, too long, over their pinned capacity), the replicas' error is returned and nothing is
stored."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Depends
from starlette.requests import Request

from gateway.admin_routes import require_admin
from gateway.pin_sync import REFUSED
from gateway.pins import GATEWAY_PIN_PREFIX, PinRecord
from gateway.state import GatewayState
from protocol.errors import APIError, bad_request, model_not_found, not_found
from protocol.parsing import parse_request
from protocol.pins import PinRequest

router = APIRouter(prefix="/admin/api/pins", dependencies=[Depends(require_admin)])


def pin_view(state: GatewayState, record: PinRecord) -> dict:
    outcomes = dict(state.pin_sync.status.get(record.pin_id, {}))
    for replica in state.serving(record.model):
        outcomes.setdefault(replica.name, {"state": "pending"})
    pinned = [o for o in outcomes.values() if o.get("num_tokens") is not None]
    return {"id": record.pin_id, "model": record.model, "excerpt": record.excerpt,
            "created": int(record.created), "cache_salt": record.prefix.get("cache_salt"),
            "num_tokens": pinned[0]["num_tokens"] if pinned else None,
            "num_blocks": pinned[0]["num_blocks"] if pinned else None,
            "replicas": outcomes}


def capacity_view(state: GatewayState) -> list[dict]:
    return [{"name": r.name, "models": r.models, "pinned_blocks": r.load.get("pinned_blocks"),
             "max_pinned_blocks": r.load.get("max_pinned_blocks"),
             "num_total_blocks": r.load.get("num_total_blocks")} for r in state.replicas.values()]


@router.get("")
async def list_pins(request: Request) -> dict:
    state: GatewayState = request.app.state.gateway
    records = await state.pin_store.all()
    return {"data": [pin_view(state, r) for r in records], "replicas": capacity_view(state)}


@router.post("")
async def create_pin(request: Request) -> dict:
    state: GatewayState = request.app.state.gateway
    body = parse_request(PinRequest, await request.body())
    if not state.serving(body.model):
        raise model_not_found(body.model)
    prefix = body.model_dump(mode="json", exclude_none=True, exclude={"model", "id"})
    pin_id = body.id or GATEWAY_PIN_PREFIX + secrets.token_hex(6)
    existing = await state.pin_store.get(pin_id)
    if existing is not None and (existing.model, existing.prefix) != (body.model, prefix):
        raise bad_request(f"Pin id {pin_id!r} already pins a different prefix.", "id", "invalid_value")
    record = existing or PinRecord(pin_id, body.model, prefix, body.describe())
    outcomes = await state.pin_sync.push_all(record)
    if outcomes and all(o["state"] == REFUSED for o in outcomes.values()):
        state.pin_sync.status.pop(pin_id, None)
        raise _replica_error(next(iter(outcomes.values())))
    await state.pin_store.put(record)
    return pin_view(state, record)


@router.delete("/{pin_id}")
async def delete_pin(request: Request, pin_id: str) -> dict:
    state: GatewayState = request.app.state.gateway
    if not await state.pin_store.delete(pin_id):
        raise not_found(f"No pin with id {pin_id!r}.")
    await state.pin_sync.remove_all(pin_id)
    return {"id": pin_id, "deleted": True}


def _replica_error(outcome: dict) -> APIError:
    error = outcome.get("error") or {}
    message = f"Every replica refused the pin: {outcome.get('detail')}"
    return APIError(outcome.get("http_status", 400), message, error.get("type", "invalid_request_error"),
                    error.get("param"), error.get("code"))
