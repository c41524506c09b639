"""quant_speed measures its servers in turns: c=1 requests alternate (the first server of each
turn alternating too), a server's c=16 wave never overlaps another's, and each server's figures
come from its own requests. Two loopback fake OpenAI servers stand in for kvgate and llama.cpp."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from benchmarks import quant_speed

TOKENS = 5


async def _fake(name: str, log: list):
    """A streaming /v1/completions server answering TOKENS tokens; logs each completion as
    (name, max_tokens, prompt, start, end)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, path = head.split(b" ")[:2]
        length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), b"0"))
        body = json.loads(await reader.readexactly(length)) if length else {}
        start = time.perf_counter()
        if method == b"GET":
            payload = json.dumps({"data": [{"id": name}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"connection: close\r\n\r\n")
            count = min(TOKENS, body["max_tokens"])
            for _ in range(count):
                await asyncio.sleep(0.002)
                writer.write(b"data: %s\n\n" % json.dumps({"choices": [{"text": "x"}]}).encode())
                await writer.drain()
            usage = {"completion_tokens": count, "prompt_tokens": len(body["prompt"].split())}
            writer.write(b"data: %s\n\ndata: [DONE]\n\n" % json.dumps(
                {"choices": [], "usage": usage}).encode())
            log.append((name, body["max_tokens"], body["prompt"], start, time.perf_counter()))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


def test_servers_take_turns(monkeypatch):
    monkeypatch.setattr(quant_speed, "prompt_texts",
                        lambda count, tokens, offset=0, model="default":
                        [f"p{offset + i} " + "w " * (tokens // 10) for i in range(count)])
    args = argparse.Namespace(c1_requests=4, concurrency=3, prefill_requests=2, max_tokens=TOKENS,
                              model="default")
    log: list = []

    async def run():
        a, url_a = await _fake("a", log)
        b, url_b = await _fake("b", log)
        async with a, b:
            return await quant_speed.measure({"a": url_a, "b": url_b}, args)

    rows = asyncio.run(run())
    assert set(rows) == {"a", "b"}
    for row in rows.values():
        assert row["c1_tok_s"] > 0 and row["c16_tok_s"] > 0 and row["prefill_tok_s"] > 0
    measured = [entry for entry in log if entry[1] == TOKENS and not entry[2].startswith("Hello")]
    c1 = [(name, prompt) for name, _, prompt, _, _ in measured if prompt.startswith("p10")]
    # each prompt goes to both servers, one after the other; who goes first alternates
    assert [name for name, _ in c1] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [prompt for _, prompt in c1][::2] == [prompt for _, prompt in c1][1::2]
    waves = {name: [(s, e) for n, _, p, s, e in measured if n == name and p.startswith("p20")]
             for name in "ab"}
    assert len(waves["a"]) == len(waves["b"]) == 3
    assert max(e for _, e in waves["a"]) <= min(s for s, _ in waves["b"])  # a's wave, then b's
    prefill = [name for name, tokens, _, _, _ in log if tokens == 1]
    assert prefill == ["a", "b", "b", "a"]
