"""The async load client: streams `/v1/completions` (token-id prompts) or `/v1/chat/completions`
(text prompts, sent as one user message) over httpx and times every chunk.

httpx rather than the openai SDK: on this 2-core machine the client shares the CPU with the
replicas, and the SDK's per-chunk pydantic parsing costs measurable TTFT under load. The wire
format is the same OpenAI SSE stream (`stream_options.include_usage` for cached tokens)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

from benchmarks.serve_bench_workloads import Job, RequestSpec


@asynccontextmanager
async def open_stream(client: httpx.AsyncClient, url: str,
                      body: dict) -> AsyncIterator[httpx.Response]:
    """POST `body`; the streaming response, closed on leaving. Sent once more if a kept-alive
    connection turns out to have been closed by the server before it answered (httpx:
    RemoteProtocolError "Server disconnected without sending a response"): llama-server
    closes its connections after a few requests, and a client reusing one in that instant lost
    the request."""
    response = None
    for attempt in (1, 2):
        try:
            response = await client.send(client.build_request("POST", url, json=body),
                                         stream=True)
            break
        except httpx.RemoteProtocolError:
            if attempt == 2:
                raise
    try:
        yield response
    finally:
        await response.aclose()


@dataclass(slots=True)
class RequestResult:
    group: str
    start: float  # seconds since the run began
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    token_times: list[float] = field(default_factory=list)  # run-relative time of each chunk
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    gateway: int = 0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


@dataclass(slots=True)
class LoadSpec:
    base_urls: list[str]  # …/v1; several gateways are used in turn, as an L7 balancer would
    model: str
    api_key: str | None = None
    concurrency: int = 8  # requests in flight, at most
    rate: float | None = None  # None: closed loop (jobs back to back); else jobs start at Job.arrival
    duration_s: float = 120.0  # no job starts after this; requests in flight are awaited
    request_timeout_s: float = 120.0
    window_s: float | None = None  # hard end: requests still in flight then are cut off


def check_loopback(url: str) -> None:
    """This benchmark only ever sends traffic to this machine."""
    host = urlparse(url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"serve_bench: {url} is not a loopback address; refusing to send load there")


async def discover_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=10.0) as c:
        r = await c.get(base_url.rstrip("/") + "/models", headers=headers)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])


class LoadClient:
    def __init__(self, spec: LoadSpec) -> None:
        for url in spec.base_urls:
            check_loopback(url)
        self.spec = spec
        self.results: list[RequestResult] = []
        self._sem = asyncio.Semaphore(spec.concurrency)
        self._next_gateway = 0
        self._t0 = 0.0
        self.elapsed = 0.0

    async def run(self, jobs: list[Job]) -> list[RequestResult]:
        headers = {"Authorization": f"Bearer {self.spec.api_key}"} if self.spec.api_key else {}
        limits = httpx.Limits(max_connections=self.spec.concurrency * 2, max_keepalive_connections=self.spec.concurrency * 2)
        timeout = httpx.Timeout(self.spec.request_timeout_s, connect=5.0)
        async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
            self._client = client
            self._t0 = time.perf_counter()
            run = self._closed_loop(jobs) if self.spec.rate is None else self._open_loop(jobs)
            if self.spec.window_s is None:
                await run
            else:
                try:
                    await asyncio.wait_for(run, self.spec.window_s)
                except asyncio.TimeoutError:
                    for res in self.results:
                        if not res.ok and not res.error:
                            res.error = "cut off at the end of the window"
            self.elapsed = time.perf_counter() - self._t0
        return self.results

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    async def _closed_loop(self, jobs: list[Job]) -> None:
        """`concurrency` workers take jobs in order: a saturating load for throughput."""
        queue = list(reversed(jobs))

        async def worker() -> None:
            while queue and self._now() < self.spec.duration_s:
                await self._job(queue.pop())

        await asyncio.gather(*(worker() for _ in range(self.spec.concurrency)))

    async def _open_loop(self, jobs: list[Job]) -> None:
        """Each job starts at its arrival time (capped by the semaphore): latency at a given rate."""
        tasks = []
        for job in sorted(jobs, key=lambda j: j.arrival):
            delay = job.arrival - self._now()
            if job.arrival > self.spec.duration_s:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self._job(job)))
        await asyncio.gather(*tasks)

    async def _job(self, job: Job) -> None:
        for i, stage in enumerate(job.stages):
            if i and job.think_s:
                await asyncio.sleep(job.think_s * random.uniform(0.5, 1.5))
            if self._now() >= self.spec.duration_s and i:
                return
            await asyncio.gather(*(self._request(r) for r in stage))

    def _pick_gateway(self) -> int:
        g = self._next_gateway % len(self.spec.base_urls)
        self._next_gateway += 1
        return g

    async def _request(self, spec: RequestSpec) -> None:
        async with self._sem:
            g = self._pick_gateway()
            res = RequestResult(spec.group, self._now(), gateway=g)
            self.results.append(res)
            body = {"model": self.spec.model, "max_tokens": spec.max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            if isinstance(spec.prompt, str):
                path = "/chat/completions"
                body["messages"] = [{"role": "user", "content": spec.prompt}]
            else:
                path = "/completions"
                body["prompt"] = spec.prompt
            start = time.perf_counter()
            last = None
            try:
                async with open_stream(self._client, self.spec.base_urls[g] + path,
                                       body) as resp:
                    if resp.status_code != 200:
                        res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                        return
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        now = time.perf_counter()
                        chunk = json.loads(line[6:])
                        if chunk.get("error"):
                            res.error = str(chunk["error"])[:200]
                            return
                        if any(c.get("text") or (c.get("delta") or {}).get("content")
                               for c in chunk.get("choices") or []):
                            res.token_times.append(now - self._t0)
                            if last is None:
                                res.ttft = now - start
                            else:
                                res.itl.append(now - last)
                            last = now
                        usage = chunk.get("usage")
                        if usage:
                            res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                            res.completion_tokens = int(usage.get("completion_tokens") or 0)
                            details = usage.get("prompt_tokens_details") or {}
                            res.cached_tokens = int(details.get("cached_tokens") or 0)
                res.e2e = time.perf_counter() - start
                res.ok = res.ttft is not None
                if not res.ok:
                    res.error = "no tokens streamed"
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                res.error = f"{type(exc).__name__}: {exc}"[:200]
