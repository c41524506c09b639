"""What the gateway adds: the same requests sent straight to a benchmark fixture upstream and
through `kvgate gateway`, streaming and not, open-loop at a fixed rate; then the highest rate the
gateway sustains (closed loop, many clients).

    python -m benchmarks.gateway_overhead [--rate 200] [--duration 30] [--mode both]

The upstream is a FIXTURE, not a model: a real HTTP/1.1 keep-alive server (asyncio, no
framework) that answers every completion at once with a fixed body, so the only cost that
differs between the two paths is the gateway's (parse, tokenise, hash, route, proxy). It has no
/kv endpoints, so the gateway routes it with the approximate index, as it would a vLLM server.
(`--serve-fixture --usage-headers` answers with a kvgate replica's usage headers as well,
protocol/usage_headers.py: benchmarks.envoy_picker's stand-in for kvgate replicas.)
Everything runs on loopback. The last line is JSON: {"added_p50_ms", "added_p99_ms", "max_rps"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx

from benchmarks import results_file
from benchmarks.lean_client import LeanClient, ResponseError
from protocol.usage_headers import usage_headers

FIXTURE_MODEL = "fixture-model"
_USAGE = {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
          "prompt_tokens_details": {"cached_tokens": 0}}
_CHAT = {"id": "chatcmpl-fixture", "object": "chat.completion", "created": 1, "model": FIXTURE_MODEL,
         "system_fingerprint": "fp_fixture", "choices": [{"index": 0, "message": {
             "role": "assistant", "content": "fixed answer", "refusal": None, "tool_calls": []},
             "logprobs": None, "finish_reason": "stop", "stop_reason": None}], "usage": _USAGE}
_TEXT = {"id": "cmpl-fixture", "object": "text_completion", "created": 1, "model": FIXTURE_MODEL,
         "system_fingerprint": "fp_fixture", "choices": [{"index": 0, "text": "fixed answer",
                                                          "logprobs": None, "finish_reason": "stop"}],
         "usage": _USAGE}
_MODELS = {"object": "list", "data": [{"id": FIXTURE_MODEL, "object": "model", "created": 1,
                                       "owned_by": "fixture"}]}


def _chat_events() -> list[bytes]:
    base = {"id": "chatcmpl-fixture", "object": "chat.completion.chunk", "created": 1,
            "model": FIXTURE_MODEL, "system_fingerprint": "fp_fixture"}
    deltas = [{"role": "assistant", "content": ""}, {"content": "fixed"}, {"content": " answer"}]
    events = [dict(base, choices=[{"index": 0, "delta": d, "finish_reason": None}]) for d in deltas]
    events.append(dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]))
    events.append(dict(base, choices=[], usage=_USAGE))
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def _header_lines(headers: dict[str, str]) -> bytes:
    return b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())


def _response(status: int, body: bytes, content_type: str = "application/json",
              extra: dict[str, str] | None = None) -> bytes:
    reason = {200: "OK", 404: "Not Found"}.get(status, "OK")
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n").encode() + _header_lines(extra or {}) + b"\r\n" + body


def _chunked(events: list[bytes], extra: dict[str, str] | None = None) -> bytes:
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            + _header_lines(extra or {}) + b"\r\n")
    return head + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


def _answers(usage: dict[str, str] | None) -> tuple[dict[tuple[str, str], bytes], bytes]:
    """The fixed answers by (method, path), and the streamed chat answer; `usage`: headers the
    completions carry (a kvgate replica's usage headers)."""
    fixed = {
        ("GET", "/health"): _response(200, b"{}"),
        ("GET", "/v1/models"): _response(200, json.dumps(_MODELS).encode()),
        ("POST", "/v1/chat/completions"): _response(200, json.dumps(_CHAT).encode(), extra=usage),
        ("POST", "/v1/completions"): _response(200, json.dumps(_TEXT).encode(), extra=usage),
    }
    return fixed, _chunked(_chat_events(), usage)


_NOT_FOUND = _response(404, b'{"error":{"message":"not found","type":"invalid_request_error","param":null,"code":"not_found"}}')


_PLAIN = _answers(None)


async def _serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            answers: tuple[dict[tuple[str, str], bytes], bytes] = _PLAIN) -> None:
    fixed, streamed = answers
    try:
        while True:
            line = await reader.readline()
            if not line:
                break
            method, target = line.split(b" ")[:2]
            length = 0
            while (header := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = header.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length) if length else b""
            path = target.decode().split("?", 1)[0]
            if method == b"POST" and b'"stream":true' in body.replace(b" ", b""):
                writer.write(streamed)
            else:
                writer.write(fixed.get((method.decode(), path), _NOT_FOUND))
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError, ValueError):
        pass
    finally:
        writer.close()


def serve_fixture(port: int, with_usage_headers: bool = False) -> None:
    usage = _USAGE["prompt_tokens"], _USAGE["prompt_tokens_details"]["cached_tokens"]
    answers = _answers(usage_headers(*usage)) if with_usage_headers else _PLAIN

    async def main() -> None:
        server = await asyncio.start_server(
            lambda r, w: _serve_connection(r, w, answers), "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()
    asyncio.run(main())


# ---- the benchmark --------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def _tokenizer_folder() -> str:
    from backend_engine.model_loader import resolve_model  # the tiny model's tokenizer files

    return str(resolve_model("tiny-random").folder)


def _body(i: int, stream: bool) -> dict:
    # A shared system prompt (routable prefix) and a distinct user turn, like chat traffic.
    return {"model": FIXTURE_MODEL, "max_tokens": 16, "stream": stream, "messages": [
        {"role": "system", "content": "You are a benchmark assistant. " * 8},
        {"role": "user", "content": f"request {i}"}]}


def _client(base: str) -> LeanClient:
    # The load generator shares the 2 cores with what it measures: the leanest client Python has
    # (benchmarks/lean_client.py), the same for both paths.
    return LeanClient(base, timeout_s=30)


async def _one(client: LeanClient, path: str, body: dict) -> float | None:
    """Latency of one request (to its last byte), or None when it failed (counted, never hidden)."""
    t0 = time.perf_counter()
    try:
        if await client.post(path, json.dumps(body).encode()) != 200:
            return None
    except (ResponseError, OSError, EOFError):
        return None
    return time.perf_counter() - t0


async def open_loop(base: str, rate: float, duration: float, stream: bool) -> list[float]:
    """Requests started every 1/rate s regardless of completions; each one's latency."""
    url = "/v1/chat/completions"
    async with _client(base) as client:
        await _one(client, url, _body(-1, stream))  # warm the pool
        tasks, start = [], time.perf_counter()
        for i in range(int(rate * duration)):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, url, _body(i, stream))))
        return list(await asyncio.gather(*tasks))


def _ok(latencies: list[float | None]) -> list[float]:
    return [x for x in latencies if x is not None]


async def closed_loop(base: str, clients: int, duration: float, stream: bool) -> float:
    """Completed requests per second with `clients` back-to-back senders."""
    url, done = "/v1/chat/completions", 0
    async with _client(base) as client:
        deadline = time.perf_counter() + duration

        async def worker(w: int) -> None:
            nonlocal done
            i = 0
            while time.perf_counter() < deadline:
                if await _one(client, url, _body(w * 100000 + i, stream)) is not None:
                    done += 1
                i += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(clients)))
        return done / (time.perf_counter() - t0)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=200.0, help="open-loop requests per second")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per open-loop run")
    p.add_argument("--mode", choices=["both", "plain", "stream"], default="both")
    p.add_argument("--max-rps-clients", type=int, default=32)
    p.add_argument("--max-rps-duration", type=float, default=10.0)
    p.add_argument("--serve-fixture", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--usage-headers", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_fixture:
        serve_fixture(args.port, args.usage_headers)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    up_port, gw_port = _free_port(), _free_port()
    upstream = subprocess.Popen([sys.executable, "-m", "benchmarks.gateway_overhead", "--serve-fixture",
                                 "--port", str(up_port)], env=env)
    gateway = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "gateway", "--replica",
                                f"http://127.0.0.1:{up_port}", "--port", str(gw_port),
                                "--tokenizer", f"{FIXTURE_MODEL}={_tokenizer_folder()}",
                                "--log-level", "warning"], env=env)
    direct, via = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
    try:
        _wait(direct + "/health", upstream)
        _wait(via + "/health", gateway)
        modes = {"both": [False, True], "plain": [False], "stream": [True]}[args.mode]
        results = {}
        for stream in modes:
            name = "stream" if stream else "plain"
            base_all = asyncio.run(open_loop(direct, args.rate, args.duration, stream))
            through_all = asyncio.run(open_loop(via, args.rate, args.duration, stream))
            base, through = _ok(base_all), _ok(through_all)
            if not base or not through:
                raise RuntimeError(f"{name}: every request failed")
            results[name] = {
                "errors_direct": len(base_all) - len(base), "errors_gateway": len(through_all) - len(through),
                "direct_p50_ms": 1000 * _pct(base, 0.5), "direct_p99_ms": 1000 * _pct(base, 0.99),
                "gateway_p50_ms": 1000 * _pct(through, 0.5), "gateway_p99_ms": 1000 * _pct(through, 0.99),
                "added_p50_ms": 1000 * (_pct(through, 0.5) - _pct(base, 0.5)),
                "added_p99_ms": 1000 * (_pct(through, 0.99) - _pct(base, 0.99)),
                "requests": len(through)}
        max_rps = asyncio.run(closed_loop(via, args.max_rps_clients, args.max_rps_duration, False))
    finally:
        for proc in (gateway, upstream):
            proc.terminate()
            proc.wait(timeout=10)
    detail = {"rate": args.rate, "duration_s": args.duration, "cpus": os.cpu_count(), **results}
    print(json.dumps(detail))
    worst = max(results.values(), key=lambda r: r["added_p99_ms"])
    summary = {"added_p50_ms": round(max(r["added_p50_ms"] for r in results.values()), 3),
               "added_p99_ms": round(worst["added_p99_ms"], 3), "max_rps": round(max_rps, 1)}
    print(json.dumps(summary))
    results_file.write("gateway_overhead", summary, {"args": vars(args), **detail}, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
