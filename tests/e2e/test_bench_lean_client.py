"""The routing-tier benchmarks' load client (benchmarks/lean_client.py) against loopback servers:
whole responses read (Content-Length and chunked), kept-alive connections reused, a connection
the server closed while idle replaced without losing the request, and every broken answer an
exception that drops its connection (a failure the benchmark counts), never a hang."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.gateway_overhead import _serve_connection
from benchmarks.lean_client import LeanClient, ResponseError


async def _fixture():
    """The benchmark fixture upstream on a free port; (server, base url, connections accepted)."""
    accepted = []

    async def handle(reader, writer):
        accepted.append(writer)
        await _serve_connection(reader, writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, "http://127.0.0.1:%d" % server.sockets[0].getsockname()[1], accepted


async def test_plain_and_streamed_answers_are_read_whole_on_one_kept_alive_connection():
    server, url, accepted = await _fixture()
    async with server, LeanClient(url) as client:
        for body in (b"{}", b'{"stream": true}', b"{}", b'{"stream": true}'):
            assert await client.post("/v1/chat/completions", body) == 200
        assert await client.post("/nowhere", b"{}") == 404
        assert len(accepted) == 1
        statuses = await asyncio.gather(*(client.post("/v1/chat/completions", b'{"stream":true}')
                                          for _ in range(5)))
        assert statuses == [200] * 5 and len(accepted) == 5  # one connection per request in flight


async def test_a_connection_the_server_closed_while_idle_is_replaced():
    server, url, accepted = await _fixture()
    async with server, LeanClient(url) as client:
        assert await client.post("/v1/chat/completions", b"{}") == 200
        accepted[0].close()  # the server's idle timeout
        await asyncio.sleep(0.05)
        assert await client.post("/v1/chat/completions", b"{}") == 200
        assert len(accepted) == 2


async def _answering(reply: bytes, then_close: bool = True):
    served = []

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        served.append(writer)
        writer.write(reply)
        await writer.drain()
        if then_close:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, "http://127.0.0.1:%d" % server.sockets[0].getsockname()[1], served


@pytest.mark.parametrize("reply", [
    b"SSH-2.0-OpenSSH\r\n",  # not HTTP
    b"HTTP/1.1 2xx OK\r\n\r\n",  # no status code
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n",  # the headers never end
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",  # not a chunk size
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\nshort",  # a chunk cut short
    b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",  # a body cut short
])
async def test_a_broken_answer_is_an_error_and_its_connection_is_not_reused(reply):
    server, url, served = await _answering(reply)
    async with server, LeanClient(url, timeout_s=5) as client:
        with pytest.raises((ResponseError, EOFError, OSError)):
            await client.post("/v1/chat/completions", b"{}")
        assert client._idle == []


async def test_connection_close_and_a_body_to_the_end_of_the_connection():
    reply = b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it"
    server, url, served = await _answering(reply)
    async with server, LeanClient(url) as client:
        assert await client.post("/", b"{}") == 200
        assert await client.post("/", b"{}") == 200
        assert len(served) == 2 and client._idle == []


async def test_a_server_that_never_answers_times_out():
    server, url, served = await _answering(b"", then_close=False)
    async with server, LeanClient(url, timeout_s=0.3) as client:
        with pytest.raises(TimeoutError):
            await client.post("/", b"{}")


def test_only_plain_http_origins():
    with pytest.raises(ValueError, match="http://"):
        LeanClient("https://127.0.0.1:1")
