"""A replica with a KV tier, over HTTP: a prefix evicted from its pool comes back as
`cached_tokens`, its snapshot and events name the tier's blocks, its metrics count the hits,
and a gateway's router fed by that snapshot prefers it to an empty replica (tier_hit)."""

import httpx
import pytest

from backend_engine.config import EngineConfig
from backend_engine.server.settings import ServerSettings
from routing.hashing import block_hashes, namespace_for
from routing.router import Router
from tests.backend_engine.server.harness import start_server
from tests.backend_engine.server.test_server_kv_events import read_events

PREFIX = [300 + i for i in range(96)]  # 6 full blocks


@pytest.fixture(scope="module")
def tier_replica():
    config = EngineConfig(enforce_eager=True, model="tiny-random", num_kv_blocks=24,
                          max_num_batched_tokens=128, target_itl_ms=0, kv_offload_size_gb=0.01)
    server = start_server(config, ServerSettings(log_level="warning", kv_heartbeat_s=0.3))
    yield server
    server.stop()


def _complete(http: httpx.Client, prompt: list[int]) -> dict:
    r = http.post("/v1/completions", json={"model": "tiny-random", "prompt": prompt,
                                           "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_an_evicted_prefix_is_served_from_the_tier_and_routed_to(tier_replica):
    with httpx.Client(base_url=tier_replica.base_url, timeout=60) as http:
        model_id = http.get("/kv/snapshot").json()["model"]
        prefix = block_hashes(PREFIX, namespace_for(model_id, None), 16)
        first = _complete(http, PREFIX + [1])
        seq = http.get("/kv/snapshot").json()["seq"]
        for i in range(8):
            _complete(http, [2000 + 131 * i + j for j in range(96)])
        snapshot = http.get("/kv/snapshot").json()
        assert not set(prefix) & set(snapshot["blocks"])  # gone from the pool ...
        assert set(prefix) <= set(snapshot["tier_blocks"])  # ... kept in the tier
        seen: set[int] = set()
        read_events(http, seq, stop=lambda e: seen.update(e.get("tier_stored", [])) or
                    set(prefix) <= seen)
        assert set(prefix) <= seen

        router = Router("prefix_cost", seed=3)
        for name, snap in (("tier", snapshot), ("empty", {"seq": 0, "blocks": []})):
            router.add_replica(name)
            router.on_snapshot(name, snap)
        decision = router.route(PREFIX + [5, 6, 7], model_id)
        assert (decision.replica, decision.reason) == ("tier", "tier_hit")

        again = _complete(http, PREFIX + [5, 6, 7])
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        metrics = http.get("/metrics").text
        assert 'kvgate_kv_tier_hits_tokens_total{level="ram"} 96.0' in metrics
        assert "kvgate_kv_tier_restore_seconds_count 1.0" in metrics
        assert "kvgate_kv_tier_usage_bytes{level=\"ram\"}" in metrics
