"""What an engine tells routers about itself: its load (queue, KV usage, drain rate, pins, the
KV tier's cost) and a snapshot of the blocks its prefix cache holds, as the replica server sends
them (/kv/snapshot, /kv/events heartbeats, /load)."""

from __future__ import annotations

from backend_engine.priority import load_by_priority
from routing.hashing import NAMESPACE_RULE

# `engine` below is an LLMEngine (engine.py imports this module, so no import back)


def engine_load(engine) -> dict:  # noqa: ANN001
    scheduler, pool = engine.scheduler, engine.pool
    return {"running": len(scheduler.running),
            "waiting": len(scheduler.waiting) + engine.structured.num_pending_seqs,
            "kv_usage": round(pool.usage(), 4),
            "pending_prefill_tokens": scheduler.pending_prefill_tokens(),
            "num_free_blocks": pool.num_free_blocks,
            "num_total_blocks": pool.num_blocks,
            "pinned_blocks": pool.num_pinned_blocks,
            "drain_rate_tok_s": round(min(engine.drain_rate(), 1e9), 1),
            **({"target_itl_s": engine.budget.target_itl_s,
                "prefill_floor_tokens": engine.budget.floor_tokens} if engine.budget else {}),
            "max_pinned_blocks": pool.max_pinned_blocks,
            "by_priority": load_by_priority(scheduler.running, scheduler.waiting),
            **({"kv_transfer": engine.kv_connector.load()} if engine.kv_connector else {}),
            **({"kv_tier": tier_load(engine)} if pool.tier is not None else {})}


def tier_load(engine) -> dict:  # noqa: ANN001
    """The tier's state, and what restoring a token costs next to prefilling it (the gateway
    prices a tier hit with it)."""
    tier = engine.pool.tier
    info = tier.info()
    per_token, rate = tier.restore_seconds_per_token(), engine.drain_rate()
    if per_token is not None and 0 < rate < float("inf"):
        info["restore_cost"] = round(min(1.0, per_token * rate), 4)
    return info


def kv_snapshot(engine) -> dict:  # noqa: ANN001
    pool = engine.pool
    seq = pool.event_seq  # read before the blocks: replaying later events is idempotent
    return {"seq": seq, "block_size": engine.block_size, "namespace_rule": NAMESPACE_RULE,
            "model": engine.model_id, "blocks": pool.cached_hashes(),
            **({"tier_blocks": pool.tier_hashes()} if pool.tier is not None else {}),
            "load": engine_load(engine)}
