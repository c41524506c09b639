"""One attempt against one replica: send the request over the pooled keep-alive client and
classify what comes back before the first body byte (the only point where a retry is safe)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx

from gateway.replicas import Replica

FORWARDED_HEADERS = ("content-type", "accept", "x-request-id", "user-agent")


class UpstreamFailure(Exception):
    """The replica failed before answering: try another one."""

    def __init__(self, reason: str, message: str, status: int | None = None,
                 body: bytes | None = None, retry_after_s: float | None = None,
                 replica: str | None = None) -> None:
        super().__init__(message)
        # "connect", "timeout", "status_5xx", "protocol", "down", or "overloaded": a healthy
        # replica whose queue is too long to take the request now (503 engine_overloaded)
        self.reason = reason
        self.status = status
        self.body = body
        self.retry_after_s = retry_after_s
        self.replica = replica  # for "down": the replica the health checks found down


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int


async def open_upstream(client: httpx.AsyncClient, replica: Replica, path: str, body: bytes,
                        headers: dict[str, str]) -> httpx.Response:
    """The replica's response with its body still unread; raises UpstreamFailure for 5xx and
    transport errors."""
    request = client.build_request("POST", replica.url + path, content=body, headers=headers)
    try:
        response = await client.send(request, stream=True)
    except httpx.ConnectError as exc:
        raise UpstreamFailure("connect", f"cannot connect to {replica.name}: {exc}") from exc
    except httpx.TimeoutException as exc:
        raise UpstreamFailure("timeout", f"{replica.name} timed out: {type(exc).__name__}") from exc
    except httpx.HTTPError as exc:  # connection reset, broken keep-alive connection, …
        raise UpstreamFailure("protocol", f"{replica.name} failed: {type(exc).__name__}") from exc
    if response.status_code >= 500:
        try:
            content = await response.aread()
        except httpx.HTTPError:
            content = b""
        finally:
            await response.aclose()
        if _overloaded(response.status_code, content):
            retry = _seconds(response.headers.get("retry-after"))
            raise UpstreamFailure("overloaded", f"{replica.name} is overloaded", 503, content, retry)
        raise UpstreamFailure("status_5xx", f"{replica.name} answered {response.status_code}",
                              response.status_code, content)
    return response


def _overloaded(status: int, content: bytes) -> bool:
    if status != 503 or b"engine_overloaded" not in content:
        return False
    try:
        return json.loads(content)["error"]["code"] == "engine_overloaded"
    except (ValueError, KeyError, TypeError):
        return False


def _seconds(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value is not None else 1.0
    except ValueError:
        return 1.0


async def open_until_down(client: httpx.AsyncClient, replica: Replica, path: str, body: bytes,
                          headers: dict[str, str], watch: tuple[Replica, ...] = ()) -> httpx.Response:
    """`open_upstream`, given up as soon as the health checks find the replica down: a hung
    replica (accepting connections, never answering) would otherwise hold the request until the
    read timeout, although nothing has reached the client yet and a retry is safe. `watch`:
    other replicas the answer depends on (a prefill half waits on its decode replica)."""
    attempt = asyncio.ensure_future(open_upstream(client, replica, path, body, headers))
    down = asyncio.get_running_loop().create_future()
    watched = (replica, *watch)
    for r in watched:
        r.down_waiters.add(down)
    try:
        await asyncio.wait((attempt, down), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for r in watched:
            r.down_waiters.discard(down)
        if not attempt.done():
            attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)
    if attempt.cancelled():
        name = down.result() if down.done() else replica.name
        raise UpstreamFailure("down", f"{name} stopped answering (health check)", replica=name)
    return attempt.result()


def forwarded_headers(incoming) -> dict[str, str]:  # noqa: ANN001 - starlette Headers
    headers = {name: incoming[name] for name in FORWARDED_HEADERS if name in incoming}
    headers["content-type"] = "application/json"
    return headers


def usage_of(payload: dict) -> Usage | None:
    """Usage of a chat or completions body or chunk, of a response (or its final event), or of
    a Message (or its message_start / message_delta event)."""
    if isinstance(payload, dict):
        for wrapper in ("response", "message"):  # a Responses or Messages API event
            if isinstance(payload.get(wrapper), dict):
                payload = payload[wrapper]
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(usage, dict):
        return None
    if "cache_read_input_tokens" in usage and usage.get("input_tokens") is not None:
        cached = int(usage.get("cache_read_input_tokens") or 0)  # Anthropic's: input is uncached
        created = int(usage.get("cache_creation_input_tokens") or 0)
        return Usage(int(usage["input_tokens"]) + cached + created, cached)
    if "input_tokens" in usage:  # the Responses API's names
        details = usage.get("input_tokens_details") or {}
        return Usage(int(usage["input_tokens"]), int(details.get("cached_tokens") or 0))
    if "prompt_tokens" not in usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return Usage(int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0))


class UsageScanner:
    """Finds the usage chunk of an SSE stream as the bytes pass through, without holding them."""

    def __init__(self) -> None:
        self._partial = b""
        self.usage: Usage | None = None

    def feed(self, chunk: bytes) -> None:
        data = self._partial + chunk
        events = data.split(b"\n\n")
        self._partial = events.pop()
        if len(self._partial) > 1 << 20:
            self._partial = b""  # no event is that large: not SSE, stop looking
        for event in events:
            if event.startswith(b"event: "):  # a named event (Responses API): data follows
                event = event.partition(b"\n")[2]
            if b'"usage"' not in event or not event.startswith(b"data: {"):
                continue
            try:
                found = usage_of(json.loads(event[6:]))
            except ValueError:
                continue
            if found is not None:
                self.usage = found
