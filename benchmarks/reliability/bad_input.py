"""Hand-written bad input, sent to the gateway and to a replica alike: each case must get its
OpenAI error (status and error object), never a 5xx, and leave no KV block or booking behind."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field

import httpx

from benchmarks.reliability.cluster import MODEL
from benchmarks.reliability.load import is_openai_error
from benchmarks.reliability.result import ScenarioResult

JSON = {"content-type": "application/json"}


@dataclass(slots=True)
class Case:
    name: str
    content: bytes
    expect: tuple[int, ...]  # acceptable statuses
    path: str = "/v1/completions"
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))


def _json(payload: object) -> bytes:
    return json.dumps(payload).encode()


def _completion(**fields: object) -> bytes:
    return _json({"model": MODEL, "prompt": "hello", "max_tokens": 2, **fields})


def _nested(depth: int) -> bytes:
    return b'{"model":"' + MODEL.encode() + b'","prompt":' + b"[" * depth + b"]" * depth + b"}"


def cases(max_body_bytes: int) -> list[Case]:
    return [
        Case("invalid JSON", b'{"model": "tiny-random", "prompt": ', (400,)),
        Case("invalid UTF-8", b'{"model":"tiny-random","prompt":"\xff\xfe\xfa"}', (400,)),
        Case("empty body", b"", (400,)),
        Case("JSON that is not an object", b"[1, 2, 3]", (400,)),
        Case("NaN where a number goes", b'{"model":"tiny-random","prompt":"x","temperature":NaN}', (400,)),
        Case("body over the size limit", b'{"prompt":"' + b"a" * (max_body_bytes + 1) + b'"}', (413,)),
        Case("deeply nested JSON", _nested(100_000), (400,)),
        Case("huge n", _completion(n=10**6), (400,)),
        Case("huge max_tokens", _completion(max_tokens=10**12), (400,)),
        Case("negative max_tokens", _completion(max_tokens=-1), (400,)),
        Case("huge stop list", _completion(stop=["x"] * 100_000), (400,)),
        Case("huge logprobs", _completion(logprobs=10**6), (400,)),
        Case("model that does not exist", _completion(model="no-such-model"), (404,)),
        Case("wrong content type", b"model=tiny-random&prompt=hi", (400, 415),
             headers={"content-type": "application/x-www-form-urlencoded"}),
        Case("chat with an unknown role", _json({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
             (400,), path="/v1/chat/completions"),
        Case("chat without messages", _json({"model": MODEL, "messages": []}), (400,), path="/v1/chat/completions"),
        Case("prompt of only special tokens", _completion(prompt="<|im_start|><|im_end|><|endoftext|>" * 8),
             (200,)),
        Case("prompt token ids out of the vocabulary", _completion(prompt=[10**9, -1]), (400,)),
    ]


def _check(client: httpx.Client, base_url: str, case: Case) -> str | None:
    """None when the answer is right, else what was wrong."""
    r = client.post(base_url + case.path, content=case.content, headers=case.headers, timeout=60)
    if r.status_code not in case.expect:
        return f"{case.name}: HTTP {r.status_code}, expected {case.expect}: {r.text[:160]}"
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            return f"{case.name}: HTTP {r.status_code} without a JSON body"
        if not is_openai_error(body):
            return f"{case.name}: not OpenAI's error object: {r.text[:160]}"
    return None


def header_injection(base_url: str) -> str | None:
    """A CR/LF smuggled into a forwarded header or the request id must not reach the response
    headers; sent over a raw socket, since HTTP clients refuse to send it."""
    body = _completion(request_id="id\r\nSet-Cookie: injected=1")
    host, port = base_url.removeprefix("http://").split(":")
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"X-Request-Id: abc%0d%0aSet-Cookie:%20injected=2\r\nConnection: close\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    if b"injected" in head:
        return f"header injection reached the response headers: {head[:300]!r}"
    if not head.startswith(b"http/1.1 ") or int(head[9:12]) >= 500:
        return f"header injection: {head[:80]!r}"
    return None


def bad_input(gateway_url: str, replica_url: str, max_body_bytes: int) -> ScenarioResult:
    result = ScenarioResult("hand-written bad input")
    problems: list[str] = []
    with httpx.Client() as client:
        for name, url in (("gateway", gateway_url), ("replica", replica_url)):
            for case in cases(max_body_bytes):
                result.sent += 1
                problem = _check(client, url, case)
                if problem is not None:
                    problems.append(f"{name}: {problem}")
            result.sent += 1
            problem = header_injection(url)
            if problem is not None:
                problems.append(f"{name}: {problem}")
    load = httpx.get(replica_url + "/kv/snapshot", timeout=10).json()["load"]
    result.checks["nothing left on the replica"] = (
        load["running"] + load["waiting"] == 0 and load["num_free_blocks"] == load["num_total_blocks"])
    result.failed = len(problems)
    result.succeeded = result.sent - result.failed
    result.notes["problems"] = problems
    result.checks["every case answered as expected"] = not problems
    return result
