"""KV pool exhaustion: a replica with a tiny pool gets long prompts, many at once. Requests are
preempted, queued or refused with a clear error, never crash the replica or change an answer:
each greedy answer under pressure equals the same request's answer alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.reliability.cluster import MODEL, ClusterSpec, LocalCluster, wait_until
from benchmarks.reliability.load import ERROR, LOST, OK, Outcome, send
from benchmarks.reliability.result import ScenarioResult

POOL_BLOCKS = 24  # 384 tokens of KV: room to start three of the requests below, to finish one or two


def pool_spec() -> ClusterSpec:
    """One replica with a tiny pool behind one gateway."""
    # no step budget and no admission bound: they would start only what keeps decodes inside
    # the ITL target and hold the rest at the gateway, and this scenario is about what happens
    # when more is admitted than the pool holds
    return ClusterSpec(replicas=1, gateways=1, redis=False, num_kv_blocks=POOL_BLOCKS, max_num_seqs=16,
                       engine={"target_itl_ms": 0, "max_queue_delay_s": 0})


def _prompt(i: int, words: int = 60) -> str:
    return f"case {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(words))


def _payload(i: int, max_tokens: int = 160, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": _prompt(i), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def pool_exhausted(cluster: LocalCluster, prompts: int = 8, rounds: int = 2) -> ScenarioResult:
    result = ScenarioResult("KV pool exhaustion")
    url = cluster.gateways[0].spec.url
    replica = cluster.replicas[0]
    with httpx.Client() as client:
        alone = {i: send(client, url, _payload(i)) for i in range(prompts)}
    result.checks["answers alone"] = all(o.kind == OK for o in alone.values())

    def one(i: int) -> tuple[int, Outcome]:
        with httpx.Client() as client:
            return i % prompts, send(client, url, _payload(i % prompts, stream=i % 2 == 1), deadline_s=120)

    with ThreadPoolExecutor(prompts * rounds) as pool:
        crowd = list(pool.map(one, range(prompts * rounds)))
    too_big = _too_big(url)
    outcomes = [o for _, o in crowd] + [too_big]
    result.sent = len(outcomes)
    result.succeeded = sum(o.kind == OK for o in outcomes)
    result.failed = sum(o.kind == ERROR for o in outcomes)
    result.lost = sum(o.kind == LOST for o in outcomes)
    wrong = [i for i, o in crowd if o.kind == OK and o.text != alone[i].text]
    result.notes["wrong_answers"] = len(wrong)
    result.notes["errors"] = sorted({o.detail for o in outcomes if o.kind == ERROR})
    load = cluster.engine_load(replica)
    result.notes["preemptions"] = _preemptions(replica.spec.url)
    result.checks["the pool ran out (preemptions)"] = result.notes["preemptions"] > 0
    result.checks["no wrong answer"] = not wrong
    result.checks["errors are clear (400 / 503)"] = all(
        o.detail.split()[0] in ("400", "503") for o in outcomes if o.kind == ERROR)
    result.checks["a prompt larger than the pool gets 400"] = too_big.kind == ERROR and too_big.detail.startswith("400")
    result.checks["replica alive and idle after"] = wait_until(
        lambda: (lambda e: e["running"] + e["waiting"] == 0 and e["num_free_blocks"] == e["num_total_blocks"])(
            cluster.engine_load(replica)), 10.0) is not None and replica.running()
    result.notes["kv_usage_after"] = load["kv_usage"]
    return result


def _too_big(url: str) -> Outcome:
    with httpx.Client() as client:
        payload = {**_payload(0), "prompt": _prompt(0, words=POOL_BLOCKS * 16)}
        return send(client, url, payload)


def _preemptions(replica_url: str) -> float:
    text = httpx.get(replica_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvgate_num_preemptions"))
