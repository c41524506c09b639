"""The benchmark client sends a request again when the kept-alive connection it picked had
been closed by the server before the request was read (llama-server closes its connections
after a few requests; quant_speed lost its llama.cpp row to this), and only then."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from benchmarks.serve_bench_client import open_stream

OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"


async def _serve(hang_ups: int):
    """A loopback server that reads a request and hangs up on the first `hang_ups`
    connections, then answers; returns (server, url, requests read)."""
    seen = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), b"0"))
        await reader.readexactly(length)
        seen.append(head)
        if len(seen) > hang_ups:
            writer.write(OK)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1/completions", seen


async def _post(hang_ups: int) -> tuple[int, bytes, int]:
    server, url, seen = await _serve(hang_ups)
    async with server, httpx.AsyncClient(timeout=10) as client:
        async with open_stream(client, url, {"prompt": "x"}) as response:
            return response.status_code, await response.aread(), len(seen)


def test_a_request_lost_to_a_closed_connection_is_sent_again():
    assert asyncio.run(_post(1)) == (200, b"ok", 2)


def test_a_server_that_keeps_hanging_up_is_an_error():
    with pytest.raises(httpx.RemoteProtocolError):
        asyncio.run(_post(2))
