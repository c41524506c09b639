"""An httpx transport whose keep-alive pool checks a connection out in O(1).

httpcore's own pool rescans every connection (quadratically, with a socket poll per idle one)
on each request and each response close, so a gateway holding hundreds of upstream streams
spends most of its CPU there and collapses under load. Here each origin keeps a stack of idle
HTTP/1.1 connections; a request pops one (dropping any the server has closed or that idled past
`keepalive_expiry`) or opens a new one, and closing the response pushes it back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpcore
import httpx
# httpx's own mapping of httpcore errors to httpx errors, so callers see the usual exceptions.
from httpx._transports.default import AsyncResponseStream, map_httpcore_exceptions


def _key(origin: httpcore.Origin) -> tuple:
    return origin.scheme, origin.host, origin.port  # httpcore's Origin is not hashable


class _ReturnOnClose:
    """A response body that gives its connection back to the pool once fully read and closed."""

    def __init__(self, stream, pool: "LeanPool", origin: httpcore.Origin,  # noqa: ANN001
                 connection: httpcore.AsyncHTTPConnection) -> None:
        self._stream = stream
        self._pool = pool
        self._origin = origin
        self._connection = connection

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._stream:
            yield part

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            await self._pool.release(self._origin, self._connection)


class LeanPool:
    def __init__(self, max_idle_per_origin: int = 64, keepalive_expiry: float = 4.0) -> None:
        self.max_idle_per_origin = max_idle_per_origin
        # Below uvicorn's default 5 s, so we drop an idle connection before the server does.
        self.keepalive_expiry = keepalive_expiry
        self._idle: dict[tuple, list[httpcore.AsyncHTTPConnection]] = {}  # by origin
        self.opened = 0

    def _checkout(self, origin: httpcore.Origin) -> tuple[httpcore.AsyncHTTPConnection, list]:
        stack = self._idle.setdefault(_key(origin), [])
        stale = []
        while stack:
            connection = stack.pop()  # the most recently used: the least likely to have expired
            if connection.is_idle() and not connection.has_expired():
                return connection, stale
            stale.append(connection)
        self.opened += 1
        return httpcore.AsyncHTTPConnection(origin, keepalive_expiry=self.keepalive_expiry), stale

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        connection, stale = self._checkout(request.url.origin)
        for old in stale:
            await old.aclose()
        try:
            response = await connection.handle_async_request(request)
        except BaseException:
            await connection.aclose()
            raise
        return httpcore.Response(status=response.status, headers=response.headers,
                                 content=_ReturnOnClose(response.stream, self, request.url.origin,
                                                        connection),
                                 extensions=response.extensions)

    async def release(self, origin: httpcore.Origin, connection: httpcore.AsyncHTTPConnection) -> None:
        stack = self._idle.setdefault(_key(origin), [])
        if connection.is_idle() and len(stack) < self.max_idle_per_origin:
            stack.append(connection)
        else:
            await connection.aclose()

    async def aclose(self) -> None:
        for stack in self._idle.values():
            for connection in stack:
                await connection.aclose()
        self._idle.clear()


class LeanTransport(httpx.AsyncBaseTransport):
    def __init__(self, max_idle_per_origin: int = 64, keepalive_expiry: float = 4.0) -> None:
        self.pool = LeanPool(max_idle_per_origin, keepalive_expiry)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        core = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host,
                             port=request.url.port, target=request.url.raw_path),
            headers=request.headers.raw, content=request.stream, extensions=request.extensions)
        with map_httpcore_exceptions():
            response = await self.pool.handle_async_request(core)
        return httpx.Response(status_code=response.status, headers=response.headers,
                              stream=AsyncResponseStream(response.stream),
                              extensions=response.extensions)

    async def aclose(self) -> None:
        await self.pool.aclose()
