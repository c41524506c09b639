"""Stall detection (gateway/stall_probe.py) on a cluster of one slowed replica (every engine step
0.1 s longer: a replica under a heavy batch) and one plain replica, each with a 6-block KV pool,
behind one gateway whose health checks are too slow to notice a hang first:

- two streams on the slowed replica outgrow its pool: the newer is preempted, waits for blocks,
  then recomputes — silent for seconds past the stall timeout while alive; the gateway asks the
  replica, is told `preempted`, then `running` and advancing, and leaves it there (before the
  probe it would have migrated);
- a stream whose replica hangs (SIGSTOP) continues on the other one within the stall timeout
  plus the probe timeout plus one time to first token."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.reliability.cluster import MODEL, ClusterSpec, LocalCluster, wait_until
from benchmarks.reliability.migration import StreamRead, migrations, run_streams
from benchmarks.reliability.result import ScenarioResult
from benchmarks.reliability.slow_engine import STEP_DELAY_ENV
from kvgate.launcher.child import Child

STALL_S = 1.0
PROBE_S = 1.0
STEP_DELAY_S = 0.1
TTFT_SLACK_S = 3.0
KV_BLOCKS = 6  # 96 tokens: two 70-token answers cannot both hold theirs
ANSWER_TOKENS = 60  # one time to first token on a loaded 2-core machine, with room


def stall_spec() -> ClusterSpec:
    return ClusterSpec(replicas=2, gateways=1, redis=False, num_kv_blocks=KV_BLOCKS,
                       engine={"max_num_batched_tokens": 16, "target_itl_ms": 0},
                       gateway={"health_interval_s": 5.0, "failure_threshold": 2,
                                "circuit_cooldown_s": 1.0, "max_attempts": 3,
                                "read_timeout_s": 30.0, "stream_stall_timeout_s": STALL_S,
                                "stream_stall_probe_timeout_s": PROBE_S, "migration_limit": 1})


def stall_cluster() -> LocalCluster:
    """The cluster, not yet started: its first replica runs benchmarks.reliability.slow_engine."""
    cluster = LocalCluster(stall_spec())
    slow = cluster.replicas[0].spec
    slow.argv[slow.argv.index("kvgate.cli")] = "benchmarks.reliability.slow_engine"
    slow.env[STEP_DELAY_ENV] = str(STEP_DELAY_S)
    return cluster


def _name(replica: Child) -> str:
    return replica.spec.url.removeprefix("http://")


def _drained(cluster: LocalCluster, replica: Child, draining: bool) -> None:
    """Take the replica out of the gateway's routing (or back in), so streams go to the other."""
    gateway = cluster.gateways[0]
    cluster.admin_call(gateway, "POST", f"/replicas/{_name(replica)}/{'drain' if draining else 'undrain'}")
    wait_until(lambda: cluster.replica_rows(gateway)[_name(replica)]["routable"] != draining, 30)


def _body(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}]}


def _ended_well(read: StreamRead, max_tokens: int) -> bool:
    usage = read.usage or {}
    return (read.error is None and read.answer()["finishes"] == ["length"]
            and usage.get("completion_tokens") == max_tokens)


def _preemptions(replica: Child) -> float:
    for line in httpx.get(replica.spec.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvgate_num_preemptions_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def silent_stream_kept(cluster: LocalCluster) -> ScenarioResult:
    """Two streams on the slowed replica; the second, preempted, is silent and alive."""
    result = ScenarioResult("stream silent past the stall timeout, request preempted: not migrated")
    slow, other = cluster.replicas
    before, preempted = migrations(cluster), _preemptions(slow)
    url = cluster.gateways[0].spec.url
    first, second = (StreamRead(url, _body(f"story {i}", ANSWER_TOKENS)) for i in (1, 2))
    _drained(cluster, other, True)
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(first.run)
            first.started.wait(60)
            pool.submit(second.run).result()
            running.result()
    finally:
        _drained(cluster, other, False)
    silence = max((b - a for a, b in zip(second.times, second.times[1:])), default=0.0)
    result.sent, result.succeeded = 2, sum(_ended_well(r, ANSWER_TOKENS) for r in (first, second))
    result.failed = sum(r.error is not None for r in (first, second))
    result.notes.update({"longest_silence_s": round(silence, 2), "replicas": [first.replica, second.replica],
                         "errors": [first.error, second.error]})
    result.checks["the replica preempted"] = _preemptions(slow) > preempted
    result.checks["silent longer than the stall timeout"] = silence > STALL_S
    result.checks["both finished on their replica"] = result.succeeded == 2 and \
        first.replica == second.replica == _name(slow)
    result.checks["nothing migrated"] = migrations(cluster) == before
    return result


def hung_stream_moves(cluster: LocalCluster) -> ScenarioResult:
    """A stream on the slowed replica, which then stops (SIGSTOP): the probe gets no answer."""
    result = ScenarioResult("replica hung mid-stream, health checks slower: migrated by the probe")
    slow, other = cluster.replicas
    before = migrations(cluster).get("continued", {}).get("stall", 0)
    stopped: list[float] = []

    def hang(reads: list[StreamRead]) -> None:
        _drained(cluster, other, False)
        stopped.append(time.monotonic())
        cluster.pause(slow)

    _drained(cluster, other, True)
    try:
        read = run_streams([(cluster.gateways[0].spec.url, _body("tell a story", 40))], hang)[0]
    finally:
        _drained(cluster, other, False)
        cluster.resume(slow)
    pause = max((b - a for a, b in zip(read.times, read.times[1:]) if b > stopped[0]), default=0.0) \
        if stopped else 0.0
    result.sent, result.succeeded = 1, int(_ended_well(read, 40))
    result.failed = int(read.error is not None)
    result.notes.update({"pause_after_the_hang_s": round(pause, 2), "error": read.error})
    result.checks["the stream was on the hung replica"] = read.replica == _name(slow)
    result.checks["it ends well, every token once"] = bool(result.succeeded)
    result.checks["migrated for a stall"] = \
        migrations(cluster).get("continued", {}).get("stall", 0) > before
    result.checks["within stall + probe timeout + one TTFT"] = \
        0 < pause < STALL_S + PROBE_S + TTFT_SLACK_S
    wait_until(lambda: cluster.replica_rows(cluster.gateways[0])[_name(slow)]["routable"], 60)
    return result
