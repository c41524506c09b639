"""Mid-stream migration: a kvgate replica's stream that breaks after its first byte (the
connection drops, the replica sends an error event or starts draining, the health checks find
it down, or it stalls: silent, and not busy with the request by its own account, stall_probe.py)
is continued on another replica that serves the model, from the token ids the client already
has the text of (`resume_token_ids`), and spliced into the client's stream (stream_splice.py)
— at most `migration_limit` times.
The continuation is an ordinary routed request (forward.py opens it with the cost model)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from gateway.stall_probe import SilenceWatch
from gateway.stream_splice import SHUTTING_DOWN, ReplicaErrorEvent, StreamSplice
from protocol.errors import APIError
from protocol.sse import DONE, sse_error

if TYPE_CHECKING:
    from gateway.attempts import Leg

CAUSES = ("disconnect", "error", "drain", "down", "stall")


class Interrupted(Exception):
    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


async def next_chunk(chunks: AsyncIterator[bytes], notice: asyncio.Future,
                     watch: SilenceWatch) -> bytes | None:
    """The replica's next bytes (None at the end), or Interrupted: a stall (silence that the
    replica, asked, does not explain: stall_probe.py), or `notice` resolved with a cause (the
    health checks' news of the replica)."""
    read = asyncio.ensure_future(chunks.__anext__())
    loop = asyncio.get_running_loop()
    since = loop.time()
    try:
        while True:
            await asyncio.wait((read, notice), timeout=watch.stall_s or None,
                               return_when=asyncio.FIRST_COMPLETED)
            if read.done() or notice.done() or not await watch.still_alive(loop.time() - since):
                break
    except BaseException:  # cancelled: the client left
        read.cancel()
        await asyncio.gather(read, return_exceptions=True)
        raise
    if read.done():
        try:
            return read.result()
        except StopAsyncIteration:
            return None
    read.cancel()
    await asyncio.gather(read, return_exceptions=True)
    raise Interrupted(notice.result() if notice.done() else "stall")


def _cause(exc: BaseException) -> str:
    if isinstance(exc, Interrupted):
        return exc.cause
    if isinstance(exc, ReplicaErrorEvent):
        return "drain" if exc.code == SHUTTING_DOWN else "error"
    return "disconnect"


@dataclass(slots=True)
class Migration:
    """One client stream across its legs. `current`: the leg whose stream is being relayed
    (closed by the response's on_close); `open_continuation` returns a leg, or why none."""
    splice: StreamSplice
    current: Leg | None
    limit: int
    watch: Callable[[Leg], SilenceWatch]  # how long each leg's stream may stay silent
    record: Callable[[str, str], None]  # (cause, outcome): metrics and the dashboard's stats
    open_continuation: Callable[[list[int], set[str], int], Awaitable[Leg | str]]
    close_failed: Callable[[Leg, str], Awaitable[None]]
    on_first_byte: Callable[[Leg], Awaitable[None]]  # each leg's

    async def relay(self) -> AsyncIterator[bytes]:
        tried: set[str] = set()
        migrations = 0
        while True:
            leg = self.current
            tried.add(leg.replica.name)
            notice = leg.replica.watch_stream()
            chunks = leg.upstream.aiter_raw()
            watch = self.watch(leg)
            first = True
            try:
                while not self.splice.done:
                    data = await next_chunk(chunks, notice, watch)
                    if data is None:
                        raise httpx.RemoteProtocolError("the stream ended before [DONE]")
                    if first:
                        first = False
                        await self.on_first_byte(leg)
                    for event in self.splice.feed(data):
                        yield event
                return
            except (httpx.HTTPError, Interrupted, ReplicaErrorEvent) as exc:
                cause = _cause(exc)
                detail = f"{leg.replica.name} {cause} mid-stream: {exc}"
            finally:
                leg.replica.unwatch_stream(notice)
            self.current = None
            await self.close_failed(leg, detail)
            if self.splice.finished:  # only its end was lost: finish it here
                self.record(cause, "not_needed")
                for event in self.splice.closing_events():
                    yield event
                return
            if migrations >= self.limit:
                self.record(cause, "limit_reached")
                yield _broken(f"the migration limit ({self.limit}) is reached")
                return
            opened = await self.open_continuation(self.splice.token_ids, tried, migrations + 1)
            if isinstance(opened, str):
                self.record(cause, "no_replica")
                yield _broken(opened)
                return
            migrations += 1
            self.record(cause, "continued")
            self.splice.next_leg()
            self.current = opened


def _broken(why: str) -> bytes:
    error = APIError(502, f"The replica failed while streaming and {why}; the response is "
                          "incomplete.", "server_error", None, "upstream_error")
    return sse_error(error) + DONE
