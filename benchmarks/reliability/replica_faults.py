"""Replica faults under load: one killed with SIGKILL, one paused with SIGSTOP (accepts, never
answers). Each scenario leaves the cluster as it found it: every replica up and routable."""

from __future__ import annotations

import time

import httpx

from benchmarks.reliability.cluster import LocalCluster, wait_until
from benchmarks.reliability.load import ERROR, Load, body, send
from benchmarks.reliability.result import ScenarioResult
from benchmarks.reliability.slow_proxy import SlowProxy
from kvgate.launcher.child import Child

DOWN_WITHIN_S = 5.0  # a dead or hung replica is out of routing within this bound
REJOIN_WITHIN_S = 30.0


def _name(replica: Child) -> str:
    return replica.spec.url.removeprefix("http://")


def _mixed(max_tokens: int):
    return lambda i: body(i, stream=i % 2 == 0, max_tokens=max_tokens, prefix="fault")


def _everywhere(cluster: LocalCluster, predicate) -> bool:
    return all(predicate(cluster.replica_rows(g)) for g in cluster.gateways)


def _rejoined(cluster: LocalCluster, replica: Child, result: ScenarioResult) -> None:
    name = _name(replica)
    took = wait_until(lambda: _everywhere(cluster, lambda rows: rows[name]["routable"]
                                          and rows[name]["kv_connected"]), REJOIN_WITHIN_S)
    result.notes["rejoined_after_s"] = None if took is None else round(took, 2)
    result.checks["rejoins when back"] = took is not None


def _takes_traffic_again(cluster: LocalCluster, replica: Child | str, result: ScenarioResult,
                         tries: int = 16) -> None:
    """Fresh prefixes go to the least loaded replica: the one back must get some of them."""
    name = replica if isinstance(replica, str) else _name(replica)
    seen: dict[str, int] = {}
    with httpx.Client() as client:
        for i in range(tries):
            gateway = cluster.gateways[i % len(cluster.gateways)]
            outcome = send(client, gateway.spec.url, body(i, False, 4, prefix=f"back-{time.time_ns()}"))
            seen[str(outcome.replica)] = seen.get(str(outcome.replica), 0) + 1
            result.sent += 1
            result.succeeded += outcome.kind == "ok"
            result.failed += outcome.kind == ERROR
            result.lost += outcome.kind == "lost"
    result.notes["answered_by_afterwards"] = seen
    result.checks["takes traffic again"] = name in seen


def replica_killed(cluster: LocalCluster, before: int = 12, after: int = 24, workers: int = 6,
                   max_tokens: int = 64) -> ScenarioResult:
    """Requests not yet streaming complete elsewhere; streams cut mid-way end with an OpenAI
    error event; the replica is marked down within a bound, and rejoins with its index rebuilt."""
    result = ScenarioResult("replica killed (SIGKILL)")
    victim = cluster.replicas[0]
    urls = [g.spec.url for g in cluster.gateways]
    with Load(urls, workers, _mixed(max_tokens), total=before + after) as load:
        load.wait_for(before)
        cluster.kill(victim)
        down = wait_until(lambda: _everywhere(cluster, lambda rows: rows[_name(victim)]["status"] == "down"),
                          DOWN_WITHIN_S)
    result.count(load.tally)
    errors = [o for o in load.tally.outcomes if o.kind == ERROR]
    result.notes["marked_down_after_s"] = None if down is None else round(down, 2)
    result.checks["marked down in time"] = down is not None
    # Only streams the victim had already answered may fail, and only with an error event.
    result.checks["only cut streams fail"] = all(
        o.stream and o.replica == _name(victim) and "upstream_error" in o.detail for o in errors)
    cluster.start([victim])
    _rejoined(cluster, victim, result)
    snapshot = httpx.get(victim.spec.url + "/kv/snapshot", timeout=10).json()
    result.checks["index rebuilt from the new snapshot"] = _everywhere(
        cluster, lambda rows: rows[_name(victim)]["index_blocks"] == len(snapshot["blocks"]))
    _takes_traffic_again(cluster, victim, result)
    return result


def _prefix_held_by(cluster: LocalCluster, replica: Child, tries: int = 24) -> str | None:
    """A fresh prefix that the gateways now route to `replica` (it holds it in its cache)."""
    with httpx.Client() as client:
        for i in range(tries):
            prefix = f"held-{time.time_ns()}-{i}"
            outcome = send(client, cluster.gateways[0].spec.url, body(0, False, 2, prefix=prefix))
            if outcome.replica == _name(replica):
                return prefix
    return None


def replica_hung(cluster: LocalCluster, before: int = 8, after: int = 8, workers: int = 4,
                 max_tokens: int = 16, pause_s: float = 10.0, probes: int = 4) -> ScenarioResult:
    """A paused replica (the kernel still accepts its connections) is taken out of routing by
    the health checks; requests already waiting on it for an answer move to another replica
    instead of sitting out the pause; when it resumes, streams it held go on, and traffic comes
    back to it."""
    result = ScenarioResult("replica hung (SIGSTOP)")
    victim = cluster.replicas[0]
    urls = [g.spec.url for g in cluster.gateways]
    prefix = _prefix_held_by(cluster, victim)
    result.checks["a prefix lands on the victim"] = prefix is not None
    # Sent the moment it stops: routed to it (it holds their prefix) before the checks notice.
    waiting = Load(urls, probes, lambda i: body(0, False, 4, prefix=prefix or "none"), total=probes)
    with Load(urls, workers, _mixed(max_tokens), deadline_s=60.0) as load:
        load.wait_for(before)
        cluster.pause(victim)
        t_paused = time.monotonic()
        with waiting:
            out = wait_until(lambda: _everywhere(cluster, lambda rows: not rows[_name(victim)]["routable"]),
                             DOWN_WITHIN_S)
            result.notes["out_of_routing_after_s"] = None if out is None else round(out, 2)
            result.checks["out of routing in time"] = out is not None
            time.sleep(max(0.0, pause_s - (time.monotonic() - t_paused)))
            result.notes["sent_while_paused"] = load.tally.sent - before
            cluster.resume(victim)
        load.wait_for(load.tally.sent + after)
    result.count(load.tally).count(waiting.tally)
    waited = max((o.elapsed_s for o in waiting.tally.outcomes), default=0.0)
    result.notes["slowest_waiting_request_s"] = round(waited, 2)
    # Before its first byte a request may move: none should sit out the pause.
    result.checks["requests waiting on it move away"] = waited < DOWN_WITHIN_S + 1.0 and all(
        o.kind == "ok" and o.replica != _name(victim) for o in waiting.tally.outcomes)
    result.checks["nothing fails"] = result.failed == 0
    _rejoined(cluster, victim, result)
    _takes_traffic_again(cluster, victim, result)
    return result


def replica_slow(cluster: LocalCluster, before: int = 8, after: int = 8, workers: int = 4,
                 delay_s: float = 1.5, slow_for_s: float = 5.0) -> ScenarioResult:
    """A replica reached through a proxy that delays every chunk it sends: its health checks time
    out, the circuit opens, traffic moves away without a failure, and comes back once it is fast
    again. The gateways know that replica only through the proxy while the scenario runs."""
    result = ScenarioResult("replica slow (delaying proxy)")
    upstream = cluster.replicas[-1]
    direct, name = _name(upstream), "slow-proxy"
    urls = [g.spec.url for g in cluster.gateways]
    host, port = direct.split(":")
    with SlowProxy(host, int(port)) as proxy:
        for gateway in cluster.gateways:
            cluster.admin_call(gateway, "DELETE", f"/replicas/{direct}")
            cluster.admin_call(gateway, "POST", "/replicas", {"url": proxy.url, "name": name})
        try:
            joined = wait_until(lambda: _everywhere(cluster, lambda rows: rows[name]["routable"]), REJOIN_WITHIN_S)
            result.checks["proxy joins"] = joined is not None
            with Load(urls, workers, lambda i: body(i, i % 2 == 0, 8, prefix="slow"), deadline_s=60.0) as load:
                load.wait_for(before)
                proxy.delay_s = delay_s
                out = wait_until(lambda: _everywhere(cluster, lambda rows: not rows[name]["routable"]),
                                 DOWN_WITHIN_S)
                result.notes["out_of_routing_after_s"] = None if out is None else round(out, 2)
                result.checks["out of routing in time"] = out is not None
                states = {cluster.replica_rows(g)[name]["circuit"] for g in cluster.gateways}
                result.notes["circuit"] = sorted(states)
                result.checks["circuit opened"] = states <= {"open", "half_open"}
                time.sleep(slow_for_s)
                proxy.delay_s = 0.0
                load.wait_for(load.tally.sent + after)
            result.count(load.tally)
            result.checks["nothing fails"] = result.failed == 0
            back = wait_until(lambda: _everywhere(cluster, lambda rows: rows[name]["routable"]
                                                  and rows[name]["kv_connected"]), REJOIN_WITHIN_S)
            result.notes["routable_again_after_s"] = None if back is None else round(back, 2)
            result.checks["comes back when fast again"] = back is not None
            _takes_traffic_again(cluster, name, result)
        finally:
            for gateway in cluster.gateways:
                cluster.admin_call(gateway, "DELETE", f"/replicas/{name}")
                cluster.admin_call(gateway, "POST", "/replicas", {"url": upstream.spec.url, "name": direct})
    result.checks["direct route restored"] = wait_until(
        lambda: _everywhere(cluster, lambda rows: rows[direct]["routable"] and rows[direct]["kv_connected"]),
        REJOIN_WITHIN_S) is not None
    return result
