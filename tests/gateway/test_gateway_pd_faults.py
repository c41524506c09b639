"""P/D faults through the gateway, with real processes and a bad network (tcp_proxy.py) between
the prefill replica and the decode replica's KV receiver: a corrupted transfer, a client that
leaves mid-transfer, a prefill replica killed mid-transfer, a decode replica killed mid-transfer
and mid-decode. Each request still gets a whole answer (or, once streaming, an OpenAI error
event), and no replica keeps a block or a booking afterwards."""

import json
import socket
import threading

import httpx
import pytest

from tests.gateway import procs
from tests.gateway.tcp_proxy import FaultProxy

MODEL = procs.MODEL
TIMEOUT = 2  # kv_timeout_s: how soon a silent peer fails a transfer


def _kv_transfer(**config) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({"kv_timeout_s": TIMEOUT, **config})


def _decode_proc(kv_port: int, proxy: FaultProxy, port: int | None = None) -> procs.Proc:
    return procs.replica(port, *_kv_transfer(kv_role="kv_consumer", kv_port=kv_port,
                                             kv_address=proxy.address))


@pytest.fixture(scope="module")
def cluster():
    kv_port = procs.free_port()
    proxy = FaultProxy(kv_port)
    nodes = {"prefill": procs.replica(None, *_kv_transfer(kv_role="kv_producer")),
             "decode": _decode_proc(kv_port, proxy), "both": procs.replica()}
    gw = procs.gateway([p.url for p in nodes.values()])
    try:  # stops every process even when one fails to start
        procs.start_all(list(nodes.values()))
        gw.start()
        assert procs.wait_until(lambda: _roles(gw) >= {"prefill", "decode", "both"}, 30)
        yield gw, nodes, proxy, kv_port
    finally:
        proxy.close()
        for p in (gw, *nodes.values()):
            p.stop()


def _roles(gw) -> set[str]:
    return {r["role"] for r in procs.admin(gw, "/replicas").json()["data"] if r["health"] == "healthy"}


def _name(proc: procs.Proc) -> str:
    return proc.url.split("//")[1]


def _load(proc: procs.Proc) -> dict:
    return httpx.get(proc.url + "/kv/snapshot", timeout=5).json()["load"]


def _clean(proc: procs.Proc) -> bool:
    """No block held by anything: requests, transfers or claims."""
    load = _load(proc)
    kv = load.get("kv_transfer") or {}
    return load["num_free_blocks"] == load["num_total_blocks"] and not kv.get("held_blocks") \
        and not kv.get("in_flight") and load["running"] == load["waiting"] == 0


def _gateway_idle(gw) -> bool:
    replicas = procs.admin(gw, "/replicas").json()["data"]
    return all(r["in_flight"] == 0 for r in replicas) and procs.admin(gw, "/pd").json()["transfers_in_flight"] == 0


def _body(tag: str, max_tokens: int = 12, stream: bool = True) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": procs.long_system_prompt(tag, words=480)}]}


def _answer(url: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    return text


def _in_background(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _transfer_under_way(decode: procs.Proc) -> bool:
    return (_load(decode).get("kv_transfer") or {}).get("in_flight", 0) > 0


def test_a_corrupted_transfer_is_caught_and_the_request_moves_on(cluster):
    gw, nodes, proxy, _ = cluster
    body = _body("corrupt")
    expected = _answer(nodes["both"].url, body)
    before = _load(nodes["decode"])["kv_transfer"]["checksum_failures"]
    proxy.corrupt_at = proxy.forwarded + 20_000  # inside the first chunk of block data
    assert _answer(gw.url, body) == expected
    assert _load(nodes["decode"])["kv_transfer"]["checksum_failures"] == before + 1
    assert procs.admin(gw, "/pd").json()["failures"].get("kv_transfer_failed", 0) >= 1
    assert procs.wait_until(lambda: _clean(nodes["prefill"]) and _clean(nodes["decode"]), 15)
    assert procs.wait_until(lambda: _gateway_idle(gw), 10)


def test_a_client_leaving_during_the_transfer_leaks_nothing(cluster):
    gw, nodes, proxy, _ = cluster
    proxy.bytes_per_s = 40_000  # the transfer now takes seconds
    try:
        payload = json.dumps(_body("leaving")).encode()
        client = socket.create_connection(("127.0.0.1", gw.port))
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        assert procs.wait_until(lambda: _transfer_under_way(nodes["decode"]), 30)
        client.close()  # the client leaves mid-transfer
        assert procs.wait_until(lambda: _gateway_idle(gw), 15)
        assert procs.wait_until(lambda: _clean(nodes["prefill"]) and _clean(nodes["decode"]), 20)
    finally:
        proxy.bytes_per_s = None


def test_a_prefill_replica_killed_mid_transfer_loses_no_request(cluster):
    gw, nodes, proxy, _ = cluster
    body = _body("kill-prefill")
    expected = _answer(nodes["both"].url, body)
    proxy.bytes_per_s = 40_000
    try:
        thread, out = _in_background(_answer, gw.url, body)
        assert procs.wait_until(lambda: _transfer_under_way(nodes["decode"]), 30)
        nodes["prefill"].kill()
        thread.join(60)
        assert out.get("value") == expected, out
        assert procs.wait_until(lambda: _clean(nodes["decode"]), 20)  # its reservation timed out
        assert procs.wait_until(lambda: _gateway_idle(gw), 10)
    finally:
        proxy.bytes_per_s = None
        nodes["prefill"].start()
    assert procs.wait_until(lambda: "prefill" in _roles(gw), 30)


def test_a_decode_replica_killed_mid_transfer_loses_no_request(cluster):
    gw, nodes, proxy, kv_port = cluster
    body = _body("kill-decode")
    expected = _answer(nodes["both"].url, body)
    proxy.bytes_per_s = 40_000
    try:
        thread, out = _in_background(_answer, gw.url, body)
        assert procs.wait_until(lambda: _transfer_under_way(nodes["decode"]), 30)
        nodes["decode"].kill()
        thread.join(60)
        assert out.get("value") == expected, out  # from the `both` replica
        assert procs.wait_until(lambda: _clean(nodes["prefill"]), 20)  # its holds were dropped
        assert procs.wait_until(lambda: _gateway_idle(gw), 10)
    finally:
        proxy.bytes_per_s = None
        nodes["decode"] = _decode_proc(kv_port, proxy, nodes["decode"].port).start()
    assert procs.wait_until(lambda: "decode" in _roles(gw), 30)


def test_a_decode_replica_killed_mid_decode_ends_the_stream_with_an_error_event(cluster):
    gw, nodes, _, _ = cluster
    events = []
    with httpx.stream("POST", gw.url + "/v1/chat/completions",
                      json={**_body("mid-decode", max_tokens=1000), "ignore_eos": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == _name(nodes["decode"])
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 5:
                nodes["decode"].kill()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "upstream_error"
    assert procs.wait_until(lambda: _clean(nodes["prefill"]), 10)
    assert procs.wait_until(lambda: _gateway_idle(gw), 10)
