"""`/admin/api/*` (admin key): replicas, recent decisions, time series, membership and policy
changes at run time; `/admin` serves the dashboard page (which asks for the key itself)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import HTMLResponse

from gateway.kv_events_spec import KvEventsSpecError, parse_kv_events
from gateway.replicas import Replica
from gateway.state import GatewayState
from protocol.errors import bad_request, not_found
from protocol.parsing import parse_request
from routing.policies import REGISTRY, policy_name

DASHBOARD = Path(__file__).with_name("dashboard.html")


def require_admin(request: Request) -> None:
    request.app.state.gateway.keys.admin(request)


api = APIRouter(prefix="/admin/api", dependencies=[Depends(require_admin)])
page = APIRouter()


class AddReplica(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    url: str = Field(min_length=8, pattern=r"^https?://")
    name: str | None = Field(default=None, min_length=1, max_length=128)
    kv_events: str | None = Field(default=None, min_length=6, max_length=512)  # as --kv-events


class SetPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    policy: str


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def replica_view(state: GatewayState, replica: Replica) -> dict:
    c = replica.counts
    index_state = state.router.index.replica(replica.name) if replica.name in state.router.replicas else None
    load = state.router.load.view(replica.name) if replica.name in state.router.replicas else None
    return {
        "name": replica.name, "url": replica.url, "models": replica.models,
        "role": replica.role, "kv_transfer_address": replica.kv_transfer_address,
        "kv_transfer": replica.load.get("kv_transfer"),
        "status": replica.status, "health": replica.health, "health_detail": replica.health_detail,
        "draining": replica.draining, "routable": replica.routable(),
        "circuit": replica.breaker.state, "consecutive_failures": replica.breaker.consecutive_failures,
        "index": "exact" if replica.exact else "approximate", "index_mode": replica.index_mode,
        "event_lag_s": replica.event_lag_s,
        "kv_events": None if replica.kv_feed is None else replica.kv_feed.to_dict(),
        "index_blocks": 0 if index_state is None else len(index_state.blocks),
        "tier_blocks": 0 if index_state is None else state.router.index.tier.count(index_state.slot),
        "kv_tier": replica.load.get("kv_tier"),
        "index_synced": bool(index_state and index_state.synced), "kv_connected": replica.kv_connected,
        "tokenizer_parity": replica.parity,
        "tokenizer": state.tokens.mode(replica.models[0]) if replica.models else None,
        "tokenize_calls": state.tokens.remote.calls.get(replica.url, 0),
        "engine": replica.engine, "features": sorted(replica.features),
        "in_flight": 0 if load is None else load.in_flight,
        "pending_prefill_tokens": 0 if load is None else load.pending_prefill_tokens,
        "kv_usage": float(replica.load.get("kv_usage", 0.0)),
        "pinned_blocks": replica.load.get("pinned_blocks"),
        "max_pinned_blocks": replica.load.get("max_pinned_blocks"),
        "engine_running": int(replica.load.get("running", 0)),
        "engine_waiting": int(replica.load.get("waiting", 0)),
        "requests": c.requests, "errors": c.errors, "prompt_tokens": c.prompt_tokens,
        "predicted_cached_tokens": c.predicted_cached_tokens, "cached_tokens": c.cached_tokens,
        "predicted_hit_rate": _ratio(c.predicted_cached_tokens, c.prompt_tokens),
        "actual_hit_rate": _ratio(c.cached_tokens, c.prompt_tokens),
    }


def _replica(state: GatewayState, name: str) -> Replica:
    replica = state.replicas.get(name)
    if replica is None:
        raise not_found(f"No replica named {name!r}.")
    return replica


@api.get("/replicas")
async def replicas(request: Request) -> dict:
    state: GatewayState = request.app.state.gateway
    return {"data": [replica_view(state, r) for r in state.replicas.values()]}


@api.post("/replicas")
async def add_replica(request: Request) -> dict:
    state: GatewayState = request.app.state.gateway
    body = parse_request(AddReplica, await request.body())
    if body.name is not None and body.name in state.replicas:
        raise bad_request(f"A replica named {body.name!r} exists already.", "name")
    if body.kv_events is not None:
        try:
            parse_kv_events(body.kv_events)
        except KvEventsSpecError as exc:
            raise bad_request(str(exc), "kv_events") from None
    replica = await state.add_replica(body.url, body.name, body.kv_events)
    return replica_view(state, replica)


@api.post("/replicas/{name}/drain")
async def drain_replica(request: Request, name: str) -> dict:
    state: GatewayState = request.app.state.gateway
    replica = _replica(state, name)
    replica.draining = True
    return replica_view(state, replica)


@api.post("/replicas/{name}/undrain")
async def undrain_replica(request: Request, name: str) -> dict:
    state: GatewayState = request.app.state.gateway
    replica = _replica(state, name)
    replica.draining = False
    return replica_view(state, replica)


@api.delete("/replicas/{name}")
async def remove_replica(request: Request, name: str) -> dict:
    state: GatewayState = request.app.state.gateway
    _replica(state, name)
    await state.remove_replica(name)
    return {"removed": name}


@api.get("/decisions")
async def decisions(request: Request, limit: int = Query(default=50, ge=1, le=1000)) -> dict:
    state: GatewayState = request.app.state.gateway
    recent = list(state.stats.decisions)[-limit:]
    return {"data": [d.to_dict() for d in reversed(recent)]}


@api.get("/timeseries")
async def timeseries(request: Request, since: float = Query(default=0.0)) -> dict:
    state: GatewayState = request.app.state.gateway
    return {"bucket_s": 2.0, "data": state.stats.series(since)}


@api.get("/summary")
async def summary(request: Request) -> dict:
    state: GatewayState = request.app.state.gateway
    size = state.router.index.size()
    return {**state.stats.summary(),
            "policy": state.router.policy.name, "policies": sorted(REGISTRY),
            "redis": {"configured": state.store is not None, "state": state.shared.state.value},
            "overload_queue": state.overload.summary(),
            "index": {"resident_entries": size.resident_entries,
                      "predicted_entries": size.predicted_entries,
                      "estimated_bytes": size.estimated_bytes, "evictions": size.evictions,
                      "resyncs": size.resyncs}}


@api.get("/pd")
async def prefill_decode(request: Request) -> dict:
    """Prefill/decode pairs: decisions, transfers in flight, bytes moved, transfer times."""
    state: GatewayState = request.app.state.gateway
    return state.pd.summary()


@api.get("/priorities")
async def priorities(request: Request) -> dict:
    """Requests, this gateway's in-flight bookings and TTFT by priority class; the keys'
    default priorities and bounds."""
    state: GatewayState = request.app.state.gateway
    return {"data": state.priorities.summary(state.router.load.in_flight_by_priority()),
            "keys": [{"name": k.name, "priority": k.priority, "max_priority": k.max_priority}
                     for k in state.config.api_keys]}


@api.put("/policy")
async def set_policy(request: Request) -> dict:
    state: GatewayState = request.app.state.gateway
    body = parse_request(SetPolicy, await request.body())
    try:
        name = policy_name(body.policy)
    except ValueError:
        raise bad_request(f"Unknown policy {body.policy!r}; choose from {sorted(REGISTRY)}.",
                          "policy") from None
    state.set_policy(name)
    return {"policy": state.router.policy.name}


@api.get("/prefix_advice")
async def prefix_advice(request: Request) -> dict:
    """Volatile fields that defeat the prefix cache, per (key, model); masked, never raw text."""
    state: GatewayState = request.app.state.gateway
    models = sorted({m for r in state.replicas.values() for m in r.models})
    unreadable = [m for m in models if state.tokens.local(m) is None]
    if state.advice is None:
        return {"enabled": False, "data": [], "models_without_tokenizer": unreadable}
    size, c = state.advice.size(), state.advice.config
    return {"enabled": True, "data": state.advice.snapshot(),
            "models_without_tokenizer": unreadable, "tracked": size.entries,
            "prompts_kept": size.prompts, "prompt_bytes": size.prompt_bytes,
            "min_occurrences": c.min_occurrences, "window_prompts": c.window,
            "block_size": c.block_size}


@page.get("/admin")
async def dashboard() -> HTMLResponse:
    # No key here: the page asks for it and sends it as a bearer token to /admin/api.
    return HTMLResponse(DASHBOARD.read_text(), headers={"Cache-Control": "no-store"})
