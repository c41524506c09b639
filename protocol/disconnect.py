"""Work that stops the moment the HTTP client hangs up, at either edge: the replica aborts the
engine requests and frees their KV blocks; the gateway closes its upstream connection (so the
replica does the same) and releases the request's booking."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's code; the client never sees it


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` (the body already read), cancelling it the moment the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        raise
    watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        raise ClientDisconnected()
    await asyncio.gather(watcher, return_exceptions=True)
    return task.result()
