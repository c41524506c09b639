"""Mid-stream migration under load: 50 concurrent greedy streams (completions and chats, some
with a json_schema, a forced tool call or a stop string) through both gateways while the replica
serving most of them is killed at a random point, paused (SIGSTOP) or drained (SIGTERM): every
client must read exactly what an uninterrupted run gives, with one finish_reason and the same
usage. Past the migration limit a client gets a clean OpenAI error event instead."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.reliability.cluster import MODEL, LocalCluster, wait_until
from benchmarks.reliability.result import ScenarioResult
from kvgate.launcher.child import Child

STREAMS = 50
MAX_TOKENS = 160  # long enough to be cut mid-way; the grammar-bound answers end sooner
REJOIN_WITHIN_S = 60.0
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"], "additionalProperties": False}}}


def stream_body(i: int) -> dict:
    """Five kinds in turn; the completions carry a prompt, the chats messages."""
    common = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    text = f"migrate {i}: " + "the quick brown fox " * 4
    chat = {**common, "messages": [{"role": "user", "content": text}]}
    return [{**common, "prompt": text, "ignore_eos": True},
            {**chat, "ignore_eos": True},
            {**chat, "response_format": {"type": "json_schema",
                                         "json_schema": {"name": "p", "schema": SCHEMA}}},
            {**chat, "tools": [TOOL], "tool_choice": "required"},
            {**common, "prompt": text, "stop": [" a", "e "]}][i % 5]


class StreamRead:
    """One streaming client: the events it read (and when), and what they add up to."""

    def __init__(self, base_url: str, payload: dict) -> None:
        self.base_url, self.payload = base_url, payload
        self.path = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
        self.events: list[dict] = []
        self.times: list[float] = []
        self.replica = ""
        self.started = threading.Event()  # text is flowing (or the stream ended)
        self.ended = False

    def run(self) -> "StreamRead":
        try:
            with httpx.stream("POST", self.base_url + self.path, json=self.payload, timeout=120) as r:
                self.replica = r.headers.get("x-kvgate-replica", "")
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.events.append(json.loads(line[6:]))
                        self.times.append(time.monotonic())
                        if len(self.times) >= 4:
                            self.started.set()
        finally:
            self.ended = True
            self.started.set()
        return self

    def answer(self) -> dict:
        """What a client makes of the stream: text, tool calls, finish reasons."""
        text, calls, finishes = "", {}, []
        for event in self.events:
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                text += delta.get("content") or choice.get("text") or ""
                for call in delta.get("tool_calls") or []:
                    entry = calls.setdefault(str(call["index"]), {"name": "", "arguments": ""})
                    function = call.get("function") or {}
                    entry["name"] += function.get("name") or ""
                    entry["arguments"] += function.get("arguments") or ""
                if choice.get("finish_reason"):
                    finishes.append(choice["finish_reason"])
        return {"text": text, "calls": calls, "finishes": finishes}

    @property
    def usage(self) -> dict | None:
        return next((e["usage"] for e in reversed(self.events) if e.get("usage")), None)

    @property
    def error(self) -> dict | None:
        return next((e["error"] for e in self.events if "error" in e), None)


def run_streams(payloads: list[tuple[str, dict]], fault=None,  # noqa: ANN001
                reader: type[StreamRead] = StreamRead) -> list[StreamRead]:
    """Every (base_url, payload) at once; `fault(reads)` once each has text flowing."""
    reads = [reader(url, p) for url, p in payloads]
    with ThreadPoolExecutor(len(reads)) as pool:
        futures = [pool.submit(r.run) for r in reads]
        if fault is not None:
            for r in reads:
                r.started.wait(120)
            fault(reads)
        for f in futures:
            f.result()
    return reads


def migrations(cluster: LocalCluster) -> dict[str, dict[str, int]]:
    """{outcome: {cause: streams}} summed over the gateways (the dashboard's figures)."""
    out: dict[str, dict[str, int]] = {}
    for gateway in cluster.gateways:
        for outcome, causes in cluster.admin(gateway, "/summary")["migrations"].items():
            for cause, n in causes.items():
                out.setdefault(outcome, {})[cause] = out.get(outcome, {}).get(cause, 0) + n
    return out


def _busiest(cluster: LocalCluster, reads: list[StreamRead]) -> Child:
    """The replica serving most unfinished streams (most streams, if all have ended: the
    scenario's checks then say that nothing migrated)."""
    names = ([r.replica for r in reads if r.replica and not r.answer()["finishes"]]
             or [r.replica for r in reads if r.replica])
    if not names:
        return cluster.replicas[0]
    return cluster.replica_by_address(max(set(names), key=names.count))


def _rejoined(cluster: LocalCluster, replica: Child, result: ScenarioResult) -> None:
    name = replica.spec.url.removeprefix("http://")
    took = wait_until(lambda: all(cluster.replica_rows(g)[name]["routable"] for g in cluster.gateways),
                      REJOIN_WITHIN_S)
    result.checks["the replica rejoins"] = took is not None


def streams_migrate(cluster: LocalCluster, fault: str, streams: int = STREAMS,
                    seed: int = 0) -> ScenarioResult:
    """`fault`: "kill" (SIGKILL), "hang" (SIGSTOP until the streams are done) or "drain"
    (SIGTERM: the replica's grace period runs while its streams move)."""
    result = ScenarioResult(f"{streams} streams, replica {dict(kill='killed', hang='hung', drain='drained')[fault]} mid-stream")
    urls = [g.spec.url for g in cluster.gateways]
    payloads = [(urls[i % len(urls)], stream_body(i)) for i in range(streams)]
    uninterrupted = run_streams(payloads)
    expected = [r.answer() for r in uninterrupted]
    before = migrations(cluster).get("continued", {})
    rng = random.Random(seed)
    hit: list[tuple[Child, float]] = []

    def inject(reads: list[StreamRead]) -> None:
        # a random point of the streams, counted in events rather than seconds, so that a fast
        # machine does not finish them first: the leading stream has read `goal` events
        goal = rng.randint(4, MAX_TOKENS // 4)
        while max(len(r.events) for r in reads) < goal and not all(r.ended for r in reads):
            time.sleep(0.002)
        victim = _busiest(cluster, reads)
        hit.append((victim, time.monotonic()))
        {"kill": cluster.kill, "hang": cluster.pause,
         "drain": lambda c: c.signal_group(signal.SIGTERM)}[fault](victim)

    try:
        reads = run_streams(payloads, inject)
    finally:
        if fault == "hang" and hit:
            cluster.resume(hit[0][0])
    victim, at = hit[0]
    answers = [r.answer() for r in reads]
    result.sent = result.succeeded = streams
    broken = sum(1 for r in reads if r.replica == victim.spec.url.removeprefix("http://"))
    exact = sum(a == e for a, e in zip(answers, expected))
    result.failed = sum(1 for r in reads if r.error is not None)
    result.succeeded -= streams - exact
    after = migrations(cluster).get("continued", {})
    result.notes.update({"streams_on_the_victim": broken, "exact": exact,
                         "migrated_by_cause": {c: n - before.get(c, 0) for c, n in after.items()
                                               if n > before.get(c, 0)}})
    result.checks["every client reads the uninterrupted answer"] = exact == streams
    result.checks["one finish_reason each"] = all(len(a["finishes"]) == 1 for a in answers)
    result.checks["usage counts each token once"] = all(
        _counts(r.usage) == _counts(u.usage) for r, u in zip(reads, uninterrupted))
    result.checks["streams migrated"] = sum(after.values()) > sum(before.values())
    gaps = [b - a for r in reads for a, b in zip(r.times, r.times[1:]) if b > at]
    result.notes["longest_pause_after_the_fault_s"] = round(max(gaps, default=0.0), 2)
    if fault == "kill":
        cluster.start([victim])
    elif fault == "drain":
        victim.proc.wait(timeout=60)
        result.notes["replica_exited_after_s"] = round(time.monotonic() - at, 1)
        cluster.start([victim])
    _rejoined(cluster, victim, result)
    return result


def _counts(usage: dict | None) -> tuple | None:
    """The token counts (a continuation's cached tokens are its own)."""
    if usage is None:
        return None
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def migration_limit(cluster: LocalCluster) -> ScenarioResult:
    """One stream whose replica hangs, then whose continuation's replica hangs too: with
    --migration-limit 1 the client gets one OpenAI error event, then [DONE]."""
    result = ScenarioResult("migration limit reached")
    paused: list[Child] = []

    def hang_twice(reads: list[StreamRead]) -> None:
        read = reads[0]
        first = _busiest(cluster, reads)
        cluster.pause(first)
        paused.append(first)
        seen = len(read.events)
        wait_until(lambda: len(read.events) > seen + 3, 30)  # continued on the other replica
        second = next(r for r in cluster.replicas if r is not first)
        cluster.pause(second)
        paused.append(second)

    body = {**stream_body(1), "max_tokens": 400}
    try:
        reads = run_streams([(cluster.gateways[0].spec.url, body)], hang_twice)
    finally:
        for replica in paused:
            cluster.resume(replica)
    error = reads[0].error or {}
    result.sent, result.failed = 1, int(bool(error))
    result.notes["error"] = error
    result.checks["an OpenAI error event"] = {"message", "type", "param", "code"} <= set(error) \
        and error.get("code") == "upstream_error"
    result.checks["says the limit was reached"] = "migration limit" in str(error.get("message"))
    result.checks["no finish_reason"] = not reads[0].answer()["finishes"]
    for replica in paused:
        _rejoined(cluster, replica, result)
    return result
