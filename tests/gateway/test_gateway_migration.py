"""Mid-stream migration with real replicas: a replica killed, hung (SIGSTOP) or drained (SIGTERM)
while it streams greedy answers — every client still receives exactly the uninterrupted text,
one finish_reason and the usage of an uninterrupted run (Anthropic Messages and Responses API streams
too: their events are the replica's own); past the migration limit the client gets
a clean OpenAI error event; streams from replicas that cannot resume (foreign engines) end with
the error event as before."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
import yaml

from benchmarks.reliability.migration import StreamRead, run_streams
from tests.gateway import procs

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 160
STALL_S = 1.5
PROBE_S = 1.0  # the stall gateway's probe timeout: a hung replica does not answer it


@pytest.fixture(scope="module")
def replicas():
    pair = [procs.replica(None, "--drain-grace", "60"), procs.replica(None, "--drain-grace", "60")]
    procs.start_all(pair)
    try:
        yield pair
    finally:
        for p in pair:
            if p.proc is not None and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
            p.stop()


def _gateway(tmp_path_factory, replicas, name: str, *extra: str, **config) -> procs.Proc:
    path = tmp_path_factory.mktemp(name) / "gateway.yaml"
    path.write_text(yaml.safe_dump({"failure_threshold": 1, "circuit_cooldown_s": 0.5, **config}))
    return procs.gateway([r.url for r in replicas], *extra, config=str(path)).start()


@pytest.fixture(scope="module")
def gateways(tmp_path_factory, replicas):
    """`fast`: quick health checks (drain and down notices); `stall`: health checks slower than
    its stall timeout, so the stall timeout notices a hung replica first."""
    fast = _gateway(tmp_path_factory, replicas, "fast", health_interval_s=0.3,
                    stream_stall_timeout_s=30.0)
    stall = _gateway(tmp_path_factory, replicas, "stall", health_interval_s=5.0,
                     stream_stall_timeout_s=STALL_S, stream_stall_probe_timeout_s=PROBE_S)
    try:
        yield {"fast": fast, "stall": stall}
    finally:
        fast.stop()
        stall.stop()


def body(i: int, endpoint: str = "chat", **extra) -> dict:
    common = {"model": procs.MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}, **extra}
    if endpoint == "chat":
        return {**common, "messages": [{"role": "user", "content": f"story number {i}"}]}
    return {**common, "prompt": f"story number {i}"}


def reference(gw: procs.Proc, payloads: list[dict]) -> list[str]:
    return [r.answer()["text"] for r in run_streams([(gw.url, p) for p in payloads])]


def run_with_fault(gw: procs.Proc, payloads: list[dict], fault) -> list[StreamRead]:
    """Start every stream, wait until each has text flowing, apply `fault(reads)`, finish."""
    return run_streams([(gw.url, p) for p in payloads], fault)


def victim_of(replicas, reads: list[StreamRead]) -> procs.Proc:
    names = [r.replica for r in reads if not r.answer()["finishes"]]
    busiest = max(set(names), key=names.count)
    return next(r for r in replicas if r.url == "http://" + busiest)


def migrations(gw: procs.Proc, cause: str, outcome: str = "continued") -> float:
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith("kvgate_gateway_migrations_total{") and f'cause="{cause}"' in line \
                and f'outcome="{outcome}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def assert_exact(clients, expected: list[str]) -> None:
    for c, text in zip(clients, expected):
        assert c.error is None, c.error
        assert c.answer()["text"] == text
        assert c.answer()["finishes"] == ["length"]
        assert c.usage["completion_tokens"] == MAX_TOKENS
        assert c.usage["total_tokens"] == c.usage["prompt_tokens"] + MAX_TOKENS


def wait_routable(gw: procs.Proc, replica: procs.Proc) -> None:
    name = replica.url.removeprefix("http://")
    assert procs.wait_until(lambda: any(r["name"] == name and r["routable"] for r in
                                        procs.admin(gw, "/replicas").json()["data"]), 30)


def test_killed_replica_streams_continue_exactly(replicas, gateways):
    gw = gateways["fast"]
    payloads = [body(i) for i in range(6)] + [body(i, "completions") for i in range(6, 8)]
    expected = reference(gw, payloads)
    before = migrations(gw, "disconnect") + migrations(gw, "down")
    killed = []

    def kill(clients):
        killed.append(victim_of(replicas, clients))
        killed[0].kill()

    clients = run_with_fault(gw, payloads, kill)
    assert_exact(clients, expected)
    assert migrations(gw, "disconnect") + migrations(gw, "down") > before
    continued = procs.admin(gw, "/summary").json()["migrations"]["continued"]  # the dashboard's
    assert continued.get("disconnect", 0) + continued.get("down", 0) > before
    killed[0].start()
    for g in gateways.values():
        wait_routable(g, killed[0])


class RenderedRead(StreamRead):
    """A client of Anthropic's Messages API or of OpenAI's Responses API (a payload with
    `input`): text deltas, how it ended, usage, the event types in order."""

    def __init__(self, base_url: str, payload: dict) -> None:
        super().__init__(base_url, payload)
        self.path = "/v1/responses" if "input" in payload else "/v1/messages"

    def answer(self) -> dict:
        deltas = ("content_block_delta", "response.output_text.delta")
        text = "".join(e["delta"]["text"] if e["type"] == deltas[0] else e["delta"]
                       for e in self.events if e["type"] in deltas)
        finishes = [e["delta"]["stop_reason"] if e["type"] == "message_delta" else
                    e["response"]["status"] for e in self.events
                    if e["type"] in ("message_delta", "response.completed", "response.incomplete")]
        return {"text": text, "calls": {}, "finishes": finishes,
                "types": [e["type"] for e in self.events]}

    @property
    def error(self) -> dict | None:
        return next((e["error"] for e in self.events if e.get("error")), None)

    @property
    def usage(self) -> dict:
        end = self.events[-2] if self.path == "/v1/messages" else self.events[-1]["response"]
        usage = end["usage"]  # Anthropic's input_tokens leave out the cached ones
        prompt = usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) \
            + (usage.get("cache_creation_input_tokens") or 0)
        return {"output": usage["output_tokens"], "prompt": prompt}


def test_killed_replica_messages_and_responses_streams_continue_exactly(replicas, gateways):
    gw = gateways["fast"]
    payloads = [{"model": procs.MODEL, "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0,
                 "messages": [{"role": "user", "content": f"message story {i}"}]} for i in range(3)]
    payloads += [{"model": procs.MODEL, "max_output_tokens": MAX_TOKENS, "stream": True,
                  "temperature": 0, "input": f"response story {i}"} for i in range(3)]
    uninterrupted = run_streams([(gw.url, p) for p in payloads], reader=RenderedRead)
    for i in (0, 3):  # the replica's own events: the gateway renders the same
        direct = RenderedRead(replicas[0].url, payloads[i]).run()
        assert direct.answer() == uninterrupted[i].answer() and direct.answer()["text"]
    before = migrations(gw, "disconnect") + migrations(gw, "down")
    killed = []

    def kill(clients):
        killed.append(victim_of(replicas, clients))
        killed[0].kill()

    clients = run_streams([(gw.url, p) for p in payloads], kill, reader=RenderedRead)
    for c, u in zip(clients, uninterrupted):
        assert c.error is None and c.answer() == u.answer()
        assert len(c.answer()["finishes"]) == 1 and c.usage == u.usage
    assert migrations(gw, "disconnect") + migrations(gw, "down") > before
    killed[0].start()
    for g in gateways.values():
        wait_routable(g, killed[0])


def test_hung_replica_resumes_within_the_stall_and_probe_timeouts(replicas, gateways):
    gw = gateways["stall"]
    chats = [body(i) for i in range(10, 13)]
    expected = reference(gw, chats)
    stopped = []

    def hang(clients):
        victim = victim_of(replicas, clients)
        stopped.append((victim, time.monotonic()))
        victim.proc.send_signal(signal.SIGSTOP)

    try:
        clients = run_with_fault(gw, chats, hang)
    finally:
        for victim, _ in stopped:
            victim.proc.send_signal(signal.SIGCONT)
    assert_exact(clients, expected)
    assert migrations(gw, "stall") >= 1
    victim, at = stopped[0]
    for c in clients:
        if c.replica == victim.url.removeprefix("http://"):
            gaps = [b - a for a, b in zip(c.times, c.times[1:]) if b > at]
            assert max(gaps) < STALL_S + PROBE_S + 3.0  # stall + probe timeouts, one TTFT


def test_past_the_migration_limit_the_client_gets_an_error_event(replicas, gateways):
    gw = gateways["stall"]
    hung = []

    def hang_twice(clients):
        client = clients[0]
        first = victim_of(replicas, clients)
        first.proc.send_signal(signal.SIGSTOP)
        hung.append(first)
        seen = len(client.events)
        assert procs.wait_until(lambda: len(client.events) > seen + 3, 30)  # continued elsewhere
        second = next(r for r in replicas if r is not first)
        second.proc.send_signal(signal.SIGSTOP)  # the continuation hangs too: limit 1 is reached
        hung.append(second)

    try:
        clients = run_with_fault(gw, [body(30)], hang_twice)
    finally:
        for replica in hung:
            replica.proc.send_signal(signal.SIGCONT)
    error = clients[0].error
    assert error is not None and error["code"] == "upstream_error" and error["type"] == "server_error"
    assert "migration limit (1)" in error["message"]
    assert not clients[0].answer()["finishes"] and clients[0].events[-1] == {"error": error}
    assert migrations(gw, "stall", "limit_reached") == 1


def test_streams_of_replicas_that_cannot_resume_end_with_an_error_event(tmp_path_factory, replicas):
    foreign = [f"--replica-engine={r.url}=vllm" for r in replicas]
    gw = _gateway(tmp_path_factory, replicas, "foreign", *foreign, health_interval_s=5.0,
                  stream_stall_timeout_s=STALL_S)
    hung = []

    def hang(clients):
        hung.append(victim_of(replicas, clients))
        hung[0].proc.send_signal(signal.SIGSTOP)

    try:
        clients = run_with_fault(gw, [body(40)], hang)
    finally:
        for replica in hung:
            replica.proc.send_signal(signal.SIGCONT)
        gw.stop()
    assert clients[0].error["code"] == "upstream_error"  # after the stall timeout, not 600 s
    assert "token_ids" not in json.dumps(clients[0].events)  # never asked of a foreign engine


def test_draining_replica_hands_its_streams_over_before_its_deadline(replicas, gateways):
    gw = gateways["fast"]
    chats = [body(i) for i in range(20, 23)]
    expected = reference(gw, chats)
    before = migrations(gw, "drain")
    drained = []

    def drain(clients):
        victim = victim_of(replicas, clients)
        drained.append((victim, time.monotonic()))
        victim.proc.send_signal(signal.SIGTERM)  # 60 s of grace: nobody waits for it

    clients = run_with_fault(gw, chats, drain)
    assert_exact(clients, expected)
    assert migrations(gw, "drain") > before
    victim, at = drained[0]
    assert time.monotonic() - at < 30
    victim.proc.wait(timeout=30)  # its streams gone, the replica ends long before its deadline
    victim.proc = None  # the last test: no need to bring it back

