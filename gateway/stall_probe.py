"""Is a silent stream stalled? No byte for `stream_stall_timeout_s` is not enough: a long chunked
prefill, a request preempted and queued for blocks, or a large batch keep a live request silent.
So the gateway asks the replica (`GET /v1/requests/{id}`, the id its response's `x-request-id`
named) within `stream_stall_probe_timeout_s`, and keeps waiting while the answer is

- `running` and a step advanced the request's computed tokens within the last stall timeout,
- `waiting` or `preempted`: queued on a live replica (vLLM's and Dynamo's view: preemption is
  not a failure), bounded like any silence by `read_timeout_s`,

re-asking after each further stall timeout of silence. Anything else is a stall: no answer in
time (a hung process), an unknown id (404, also what a replica without the endpoint — vLLM,
SGLang — answers: their silent streams stall by the timeout alone), `finished` without the bytes
arriving, or `running` with no step for a whole stall timeout (a stuck engine)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import quote

import httpx

from gateway.config import GatewayConfig

Probe = Callable[[], Awaitable[dict | None]]


@dataclass(slots=True)
class SilenceWatch:
    """How long a stream may stay silent: `stall_s` at a time (0: no limit short of
    `read_timeout_s`), more while `probe` (None: the replica cannot be asked) says it lives."""
    stall_s: float
    read_timeout_s: float
    probe: Probe | None = None

    async def still_alive(self, silent_s: float) -> bool:
        if self.probe is None or silent_s >= self.read_timeout_s:
            return False
        return is_alive(await self.probe(), self.stall_s)


def is_alive(answer: dict | None, stall_s: float) -> bool:
    """The replica's answer about a silent request (None: none came) → keep waiting?"""
    if not isinstance(answer, dict):
        return False
    state = answer.get("state")
    if state in ("waiting", "preempted"):
        return True
    if state != "running":
        return False
    since = answer.get("since_progress_s")
    return isinstance(since, (int, float)) and since < stall_s


def replica_probe(client: httpx.AsyncClient, url: str, response: httpx.Response,
                  timeout_s: float) -> Probe | None:
    """The question to ask about `response`'s request, if its replica named it."""
    request_id = response.headers.get("x-request-id")
    if not request_id:
        return None
    target = f"{url}/v1/requests/{quote(request_id, safe='')}"

    async def probe() -> dict | None:
        try:
            answer = await asyncio.wait_for(client.get(target, timeout=timeout_s), timeout_s)
        except (httpx.HTTPError, asyncio.TimeoutError):
            return None
        if answer.status_code != 200:
            return None
        try:
            return answer.json()
        except ValueError:
            return None

    return probe


def silence_watch(config: GatewayConfig, client: httpx.AsyncClient, url: str,
                  response: httpx.Response) -> SilenceWatch:
    return SilenceWatch(config.stream_stall_timeout_s, config.read_timeout_s,
                        replica_probe(client, url, response, config.stream_stall_probe_timeout_s))
