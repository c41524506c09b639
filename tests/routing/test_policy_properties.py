"""Properties every user of the router would notice: cache wins at equal load, saturated
replicas are avoided, identical cold requests do not herd, ties are not broken by position."""

import logging
from collections import Counter

import pytest

from routing.policies import REGISTRY, NoReplicaAvailable, ReplicaState, RouteRequest, make_policy
from routing.policies.prefix_cost import PrefixCostPolicy
from routing.router import Router

PROMPT = 2048


def request(i: int = 0, session: str | None = None) -> RouteRequest:
    return RouteRequest(f"r{i}", list(range(PROMPT // 16)), PROMPT, 16, session)


def idle(name: str, cached: int = 0, **kw) -> ReplicaState:
    return ReplicaState(name, cached_tokens=cached, **kw)


@pytest.mark.parametrize("policy", ["prefix_cost", "sglang"])
def test_replica_holding_the_prefix_wins_when_loads_are_equal(policy):
    p = make_policy(policy, seed=1)
    for i in range(200):
        replicas = [idle("a", in_flight=2), idle("b", 1600, in_flight=2), idle("c", in_flight=2)]
        assert p.choose(request(i), replicas).replica == "b"


def test_longer_cached_prefix_wins_over_shorter_one():
    p = make_policy("prefix_cost", seed=1)
    replicas = [idle("a", 512), idle("b", 1536), idle("c", 1024)]
    assert all(p.choose(request(i), replicas).replica == "b" for i in range(100))


@pytest.mark.parametrize("saturation", [{"kv_usage": 0.97}, {"waiting": 40}])
def test_saturated_replica_is_never_chosen_while_another_is_below_guard(saturation):
    p = make_policy("prefix_cost", seed=2)
    for i in range(500):
        replicas = [idle("hot", PROMPT - 16, **saturation), idle("x", in_flight=3),
                    idle("y", in_flight=3)]
        decision = p.choose(request(i), replicas)
        assert decision.replica != "hot"
        assert decision.score_of("hot").excluded in ("kv_usage", "queue")


def test_all_saturated_still_routes_and_says_so():
    p = make_policy("prefix_cost", seed=2)
    decision = p.choose(request(), [idle("a", kv_usage=0.99), idle("b", kv_usage=0.99)])
    assert decision.reason == "all_saturated"


def test_affinity_is_kept_inside_the_near_least_loaded_window():
    p = make_policy("prefix_cost", seed=3)
    for i in range(200):
        # "hot" holds the prefix but is far above the others: excluded by the window.
        # Of the replicas inside the window, the one holding half the prefix still wins.
        replicas = [idle("hot", 2000, in_flight=20), idle("half", 1024, in_flight=9),
                    idle("cold", 0, in_flight=8)]
        decision = p.choose(request(i), replicas)
        assert decision.replica == "half"
        assert decision.score_of("hot").excluded == "load_window"


def test_no_herding_of_identical_cold_requests():
    router = Router("prefix_cost", seed=4)
    for i in range(8):
        router.add_replica(f"r{i}")
    tokens = list(range(PROMPT))
    counts = Counter(router.route(tokens, "m").replica for _ in range(1000))
    assert len(counts) == 8
    assert max(counts.values()) <= 1000 / 8 * 1.1


def test_new_prefixes_spread_over_every_replica():
    router = Router("prefix_cost", seed=5)
    for i in range(4):
        router.add_replica(f"r{i}")
    decisions = []
    for i in range(8):
        d = router.route([i] * PROMPT, "m")
        router.finish(d.request_id)
        decisions.append(d.replica)
    assert Counter(decisions) == Counter({f"r{i}": 2 for i in range(4)})


@pytest.mark.parametrize("policy", ["prefix_cost", "least_load", "random", "session_affinity"])
def test_ties_are_not_broken_by_index(policy):
    p = make_policy(policy, seed=6)
    chosen = Counter()
    for i in range(400):
        replicas = [idle(n, in_flight=1) for n in ("a", "b", "c", "d")]
        chosen[p.choose(request(i, session=None), replicas).replica] += 1
    assert len(chosen) == 4 and min(chosen.values()) > 400 / 4 * 0.6


def test_round_robin_cycles():
    p = make_policy("round_robin")
    replicas = [idle("a"), idle("b"), idle("c")]
    assert [p.choose(request(i), replicas).replica for i in range(6)] == list("abcabc")


def test_prefix_hash_is_sticky_and_bounded_by_load():
    p = make_policy("prefix_hash")
    replicas = [idle(n) for n in "abcd"]
    home = p.choose(request(), replicas).replica
    assert all(p.choose(request(i), replicas).replica == home for i in range(20))
    loaded = [idle(n, in_flight=10 if n == home else 0) for n in "abcd"]
    assert p.choose(request(), loaded).replica != home


def test_session_affinity_follows_the_header_value():
    p = make_policy("session_affinity")
    replicas = [idle(n, in_flight=i) for i, n in enumerate("abcd")]
    picks = {p.choose(request(i, session="user-42"), replicas).replica for i in range(50)}
    assert len(picks) == 1
    spread = {p.choose(request(i, session=f"user-{i}"), replicas).replica for i in range(200)}
    assert spread == set("abcd")


def test_sglang_routes_to_least_loaded_under_imbalance():
    p = make_policy("sglang")
    replicas = [idle("a", 2000, in_flight=200), idle("b", in_flight=10)]
    decision = p.choose(request(), replicas)
    assert decision.replica == "b" and decision.reason == "imbalance"


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_every_policy_explains_every_replica(policy):
    p = make_policy(policy, seed=7)
    replicas = [idle("a", 512, in_flight=1, pending_prefill_tokens=100), idle("b")]
    decision = p.choose(request(session="s"), replicas)
    assert decision.policy == policy and decision.reason
    assert [s.replica for s in decision.scores] == ["a", "b"]
    assert decision.score_of("a").cached_tokens == 512


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_no_replica_is_an_error_not_a_crash(policy):
    with pytest.raises(NoReplicaAvailable):
        make_policy(policy).choose(request(), [])


def test_unknown_policy_name_lists_the_choices():
    with pytest.raises(ValueError, match="prefix_cost"):
        make_policy("nope")


def test_old_policy_name_still_builds_the_renamed_policy_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="routing.policies"):
        policy = make_policy("kvgate", seed=1)
    assert isinstance(policy, PrefixCostPolicy) and policy.name == "prefix_cost"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'kvgate' is deprecated" in warnings[0]
    assert "kvgate" not in REGISTRY  # listed choices name only the new name
