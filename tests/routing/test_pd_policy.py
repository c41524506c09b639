"""Choosing prefill/decode pairs with the prefix cost: the decode replica by cached prefix,
in-flight decodes and KV room; the prefill replica by cached prefix and pending prefill; bypass
when the decode replica already holds nearly all of the prompt; both bookings released."""

import pytest

from routing.hashing import block_hashes
from routing.policies import NoReplicaAvailable, ReplicaState, RouteRequest
from routing.policies.pd import PDPolicy
from routing.router import Router

PROMPT = 1024


def request() -> RouteRequest:
    return RouteRequest("r", [], PROMPT, 16)


def test_decode_replica_with_fewer_decodes_in_flight_wins():
    decode = [ReplicaState("d1", in_flight=12), ReplicaState("d2", in_flight=2)]
    pick = PDPolicy(seed=0).choose(request(), [ReplicaState("p1")], decode)
    assert pick.decode.replica == "d2" and pick.prefill.replica == "p1" and pick.reason == "pair"


def test_decode_replica_with_more_kv_room_wins_at_equal_load():
    decode = [ReplicaState("d1", in_flight=3, kv_usage=0.8), ReplicaState("d2", in_flight=3, kv_usage=0.2)]
    assert PDPolicy(seed=0).choose(request(), [ReplicaState("p1")], decode).decode.replica == "d2"


def test_decode_replica_holding_the_prefix_wins_over_a_slightly_idler_one():
    decode = [ReplicaState("d1", in_flight=2, cached_tokens=0),
              ReplicaState("d2", in_flight=3, cached_tokens=512)]
    assert PDPolicy(seed=0).choose(request(), [ReplicaState("p1")], decode).decode.replica == "d2"


def test_prefill_replica_is_chosen_by_cached_prefix_and_pending_prefill():
    prefill = [ReplicaState("p1", cached_tokens=0), ReplicaState("p2", cached_tokens=768)]
    assert PDPolicy(seed=0).choose(request(), prefill, [ReplicaState("d1")]).prefill.replica == "p2"
    prefill = [ReplicaState("p1", pending_prefill_tokens=6000), ReplicaState("p2")]
    assert PDPolicy(seed=0).choose(request(), prefill, [ReplicaState("d1")]).prefill.replica == "p2"


def test_bypass_when_the_decode_replica_holds_nearly_all_of_the_prompt():
    decode = [ReplicaState("d1", cached_tokens=PROMPT - 40)]
    pick = PDPolicy(seed=0, bypass_tokens=64).choose(request(), [ReplicaState("p1")], decode)
    assert pick.bypass and pick.reason == "bypass" and pick.decode.replica == "d1"


def test_short_prompts_bypass_the_prefill_replica():
    pick = PDPolicy(seed=0).choose(RouteRequest("r", [], 40, 16), [ReplicaState("p1")],
                                   [ReplicaState("d1")])
    assert pick.bypass


def test_without_prefill_replicas_the_decode_replica_prefills():
    pick = PDPolicy(seed=0).choose(request(), [], [ReplicaState("d1")])
    assert pick.bypass and pick.reason == "no_prefill_replica"


def test_no_decode_replica_is_no_pair():
    with pytest.raises(NoReplicaAvailable):
        PDPolicy(seed=0).choose(request(), [ReplicaState("p1")], [])


def test_near_equal_pairs_are_spread_not_first_index():
    policy = PDPolicy(seed=3)
    picks = {policy.choose(request(), [ReplicaState("p1"), ReplicaState("p2")],
                           [ReplicaState("d1"), ReplicaState("d2")]).decode.replica
             for _ in range(40)}
    assert picks == {"d1", "d2"}


def _router() -> Router:
    r = Router(seed=1)
    for name in ("p1", "p2", "d1", "d2"):
        r.add_replica(name)
        r.on_snapshot(name, {"seq": 0, "block_size": 16, "blocks": [], "load": {}})
    return r


def test_router_books_both_sides_and_predicts_the_blocks_on_both():
    r = _router()
    tokens = list(range(2000, 2000 + PROMPT))
    hashes = block_hashes(tokens, "m")
    pick = r.route_pd(hashes, PROMPT, "x", ["p1", "p2"], ["d1", "d2"])
    p, d = pick.prefill.replica, pick.decode.replica
    assert r.load.view(p).pending_prefill_tokens == PROMPT
    assert r.load.view(d).in_flight == 1 and r.load.view(d).pending_prefill_tokens <= 16
    matched = r.index.match(hashes)
    assert matched[p] == matched[d] == PROMPT // 16  # siblings will follow this pair
    r.finish("x-p")
    r.finish("x-d")
    assert all(r.load.view(n).in_flight == 0 for n in ("p1", "p2", "d1", "d2"))


def test_router_follows_the_pair_for_a_sibling_and_excludes_tried_replicas():
    r = _router()
    hashes = block_hashes(list(range(5000, 5000 + PROMPT)), "m")
    first = r.route_pd(hashes, PROMPT, "a", ["p1", "p2"], ["d1", "d2"])
    r.finish("a-p")
    r.finish("a-d")
    again = r.route_pd(hashes, PROMPT, "b", ["p1", "p2"], ["d1", "d2"])
    assert again.decode.replica == first.decode.replica and again.bypass  # it holds it all now
    other = r.route_pd(hashes, PROMPT, "c", ["p1", "p2"], ["d1", "d2"],
                       exclude=[first.decode.replica])
    assert other.decode.replica != first.decode.replica and not other.bypass


def test_a_failed_transfer_withdraws_the_decode_replicas_predicted_blocks():
    r = _router()
    hashes = block_hashes(list(range(9000, 9000 + PROMPT)), "m")
    pick = r.route_pd(hashes, PROMPT, "a", ["p1"], ["d1"])
    r.finish("a-p")
    r.finish("a-d")
    r.index.unpredict("d1", hashes)
    assert r.index.match(hashes).get("d1", 0) == 0
    assert r.index.match(hashes)["p1"] == PROMPT // 16  # the prefill side did compute them
    assert not r.route_pd(hashes, PROMPT, "b", ["p1"], ["d1"]).bypass
