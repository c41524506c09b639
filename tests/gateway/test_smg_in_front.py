"""SGLang's model gateway (`smg`, PyPI) in front of two kvgate replicas, as a new user would run
it: it probes the workers' metadata, re-serialises requests with SGLang's extras, and every
request is served (bounded, loopback only)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import httpx
import pytest

from tests.gateway import procs

pytestmark = pytest.mark.timeout(180)

SGLANG_EXTRAS = {"no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                 "continue_final_message": False, "separate_reasoning": True,
                 "stream_reasoning": True, "return_hidden_states": False}


def smg_binary() -> str:
    found = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    if not Path(found).exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("smg is not installed (pip install 'kvgate[test]')")
        pytest.skip("smg is not installed (pip install smg)")
    return found


@pytest.fixture(scope="module")
def smg_front():
    binary = smg_binary()
    replicas = [procs.replica(), procs.replica()]
    procs.start_all(replicas)
    port, metrics_port = procs.free_port(), procs.free_port()
    router = procs.Proc([], port, "/health", "smg")
    router.module = None
    args = [binary, "launch", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--policy", "cache_aware", "--log-level", "warn",
            "--worker-urls", *[r.url for r in replicas]]
    import subprocess

    with open(router.log, "ab") as log:
        router.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        procs.wait_until(lambda: _ready(router, replicas), 60, 0.5)
        yield replicas, router
    finally:
        router.stop()
        for r in replicas:
            r.stop()


def _ready(router, replicas) -> bool:
    try:
        r = httpx.get(router.url + "/v1/models", timeout=2)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and any(m["id"] == procs.MODEL for m in r.json().get("data", []))


def test_replicas_answer_sglang_and_vllm_metadata_probes(smg_front):
    replicas, _ = smg_front
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/version"):
        r = httpx.get(replicas[0].url + path, timeout=5)
        assert r.status_code == 200, (path, r.text)
    info = httpx.get(replicas[0].url + "/server_info", timeout=5).json()
    assert info["page_size"] == 16 and info["served_model_name"] == procs.MODEL


def test_every_request_through_smg_is_served(smg_front):
    replicas, router = smg_front
    system = procs.long_system_prompt("smg")
    served = 0
    for i in range(12):
        body = {"model": procs.MODEL, "max_tokens": 3, "stream": i % 3 == 2,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"question {i}"}], **SGLANG_EXTRAS}
        r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        served += 1
    r = httpx.post(router.url + "/v1/completions", timeout=60, json={
        "model": procs.MODEL, "prompt": "Once upon a time", "max_completion_tokens": 4,
        "no_stop_trim": True, "rid": "req-1"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 4
    assert served == 12
    assert sum(_served(x) for x in replicas) >= 13  # smg spread nothing elsewhere


def _served(replica) -> int:
    text = httpx.get(replica.url + "/metrics", timeout=5).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("kvgate_http_requests_total{") and '"/v1/' in line
               and 'completions' in line and 'status_code="200"' in line)


def test_sglang_extras_are_honoured_or_ignored_and_unknown_fields_refused(smg_front):
    """The body SGLang's router sends (its schema's defaults re-serialised), straight to a replica."""
    replicas, _ = smg_front
    url = replicas[0].url
    body = {"model": procs.MODEL, "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 3, **SGLANG_EXTRAS}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3
    metrics = httpx.get(url + "/metrics", timeout=5).text
    for field in ("separate_reasoning", "stream_reasoning", "return_hidden_states"):
        assert f'kvgate_request_ignored_fields_total{{field="{field}"}}' in metrics
    # A value that asks for what we cannot do is refused by name; a field of no schema too.
    r = httpx.post(url + "/v1/chat/completions", json={**body, "return_hidden_states": True}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
    bad = httpx.post(url + "/v1/chat/completions", timeout=10, json={**body, "nonsense": 1})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "unknown_parameter"
    assert json.loads(bad.text)["error"]["param"] == "nonsense"


def test_an_http2_preface_does_not_disturb_a_replica(smg_front):
    replicas, _ = smg_front
    with socket.create_connection(("127.0.0.1", replicas[0].port), timeout=5) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        s.recv(4096)  # uvicorn answers 400 or closes: either way the probe ends
    assert httpx.get(replicas[0].url + "/health", timeout=5).status_code == 200
