"""The routing-tier benchmarks' load client: HTTP/1.1 POSTs over asyncio streams, keep-alive
connections reused most-recent-first, each response read to its end (Content-Length or chunked)
without being parsed. It shares the machine's cores with the tier it measures, so it does as
little as a client can in Python: an httpx request costs about four times as much CPU, which at
hundreds of requests a second is CPU the tier under test no longer has."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit


class ResponseError(Exception):
    """The server broke the connection or sent something that is not an HTTP/1.1 response."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class LeanClient:
    """POST to one origin; `post` returns the status once the whole response has arrived."""

    def __init__(self, base_url: str, timeout_s: float = 30.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"only plain http:// origins are supported, not {base_url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.timeout_s = timeout_s
        self._idle: list[_Connection] = []
        self._host_header = f"{self.host}:{self.port}"

    async def post(self, path: str, body: bytes) -> int:
        """Send `body` as JSON to `path`; the response status. Raises ResponseError, OSError
        (TimeoutError included) or EOFError (the connection is then dropped, never reused)."""
        return await asyncio.wait_for(self._post(path, body), self.timeout_s)

    async def _post(self, path: str, body: bytes) -> int:
        request = (f"POST {path} HTTP/1.1\r\nhost: {self._host_header}\r\ncontent-type: "
                   f"application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
        while True:
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else _Connection(
                *await asyncio.open_connection(self.host, self.port))
            try:
                conn.writer.write(request)
                try:
                    status_line = await conn.reader.readline()
                except ConnectionError:
                    status_line = b""
                if not status_line and reused:
                    # the server closed the kept-alive connection before it read this request
                    # (its idle timeout): sent again on a new one, as any HTTP client does
                    conn.close()
                    continue
                status, keep_alive = await _read_response(status_line, conn.reader)
            except BaseException:
                conn.close()
                raise
            if keep_alive:
                self._idle.append(conn)
            else:
                conn.close()
            return status

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def __aenter__(self) -> "LeanClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


async def _read_response(line: bytes, reader: asyncio.StreamReader) -> tuple[int, bool]:
    """(status, may the connection be reused), from the status line and what follows it; the
    body read and dropped."""
    parts = line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ResponseError(f"not an HTTP/1.1 status line: {line[:80]!r}")
    status = _number(parts[1], 10)
    length, chunked, keep_alive = None, False, parts[0] == b"HTTP/1.1"
    while (header := await reader.readline()) not in (b"\r\n", b"\n"):
        if not header:
            raise ResponseError("the connection closed inside the response headers")
        name, _, value = header.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = _number(value, 10)
        elif name == b"transfer-encoding":
            chunked = value.endswith(b"chunked")
        elif name == b"connection":
            keep_alive = value != b"close"
    if chunked:
        while (size := _number((await reader.readline()).split(b";", 1)[0], 16)) > 0:
            await reader.readexactly(size + 2)  # the chunk and its CRLF
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
            pass  # trailers
    elif length is not None:
        await reader.readexactly(length)
    else:  # delimited by the connection's end
        await reader.read()
        keep_alive = False
    return status, keep_alive


def _number(text: bytes, base: int) -> int:
    try:
        return int(text, base)
    except ValueError:
        raise ResponseError(f"not a number: {text[:40]!r}") from None
