"""Load for the fault scenarios, and what became of each request: a complete answer, an error
in OpenAI's format (a status or a stream's error event), or lost — neither of the two, which
includes a hang past the deadline, a cut connection and a stream that stops without `[DONE]`."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from benchmarks.reliability.cluster import MODEL

OK, ERROR, LOST = "ok", "error", "lost"


@dataclass(slots=True)
class Outcome:
    kind: str  # OK | ERROR | LOST
    replica: str | None  # x-kvgate-replica, when the gateway answered
    stream: bool
    started_streaming: bool = False  # a content chunk reached the client
    detail: str = ""
    text: str = ""
    elapsed_s: float = 0.0


@dataclass(slots=True)
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def count(self, kind: str) -> int:
        return sum(1 for o in self.outcomes if o.kind == kind)

    @property
    def sent(self) -> int:
        return len(self.outcomes)


def is_openai_error(payload: object) -> bool:
    error = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


def body(i: int, stream: bool, max_tokens: int = 16, prefix: str = "soak") -> dict:
    """A completion request; ten distinct prefixes, so the index and the cache both matter."""
    return {"model": MODEL, "prompt": f"{prefix} tenant {i % 10}: " + "the quick brown fox " * 8 + f"#{i}",
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}


def send(client: httpx.Client, base_url: str, payload: dict, deadline_s: float = 60.0,
         headers: dict[str, str] | None = None) -> Outcome:
    t0 = time.monotonic()
    outcome = _send(client, base_url, payload, deadline_s, headers)
    outcome.elapsed_s = time.monotonic() - t0
    return outcome


def _send(client: httpx.Client, base_url: str, payload: dict, deadline_s: float,
          headers: dict[str, str] | None) -> Outcome:
    stream = bool(payload.get("stream"))
    try:
        if stream:
            return _send_stream(client, base_url, payload, deadline_s, headers)
        r = client.post(base_url + "/v1/completions", json=payload, headers=headers, timeout=deadline_s)
    except httpx.TimeoutException:
        return Outcome(LOST, None, stream, detail="no answer before the deadline")
    except httpx.HTTPError as exc:
        return Outcome(LOST, None, stream, detail=f"transport: {type(exc).__name__}")
    replica = r.headers.get("x-kvgate-replica")
    try:
        data = r.json()
    except ValueError:
        return Outcome(LOST, replica, stream, detail=f"HTTP {r.status_code}, not JSON")
    if r.status_code == 200 and data.get("choices") and data["choices"][0].get("finish_reason"):
        return Outcome(OK, replica, stream, text=data["choices"][0]["text"])
    if r.status_code >= 400 and is_openai_error(data):
        return Outcome(ERROR, replica, stream, detail=f"{r.status_code} {data['error']['code']}")
    return Outcome(LOST, replica, stream, detail=f"HTTP {r.status_code}: {r.text[:200]}")


def _send_stream(client: httpx.Client, base_url: str, payload: dict, deadline_s: float,
                 headers: dict[str, str] | None) -> Outcome:
    t0 = time.monotonic()
    with client.stream("POST", base_url + "/v1/completions", json=payload, headers=headers,
                       timeout=deadline_s) as r:
        replica = r.headers.get("x-kvgate-replica")
        if r.status_code != 200:
            r.read()
            try:
                ok = is_openai_error(r.json())
            except ValueError:
                ok = False
            return Outcome(ERROR if ok else LOST, replica, True, detail=f"HTTP {r.status_code}")
        text, finished, error, started = [], False, None, False
        for line in r.iter_lines():
            if time.monotonic() - t0 > deadline_s:
                return Outcome(LOST, replica, True, started, "stream past the deadline")
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                if error is not None:
                    return Outcome(ERROR, replica, True, started, f"error event {error}")
                if finished:
                    return Outcome(OK, replica, True, started, text="".join(text))
                return Outcome(LOST, replica, True, started, "[DONE] without a finish_reason")
            event = json.loads(line[6:])
            if is_openai_error(event):
                error = event["error"]["code"]
                continue
            for choice in event.get("choices", []):
                started = True
                text.append(choice.get("text") or "")
                finished = finished or bool(choice.get("finish_reason"))
        return Outcome(LOST, replica, True, started, "stream ended without [DONE]")


class Load:
    """Closed-loop load from `workers` threads, round robin over `base_urls`, until stopped or
    `total` requests were sent; runs in the background while a scenario injects its fault."""

    def __init__(self, base_urls: list[str], workers: int, make_body: Callable[[int], dict],
                 total: int | None = None, deadline_s: float = 60.0,
                 headers: dict[str, str] | None = None, pause_s: float = 0.0) -> None:
        self.base_urls, self.workers, self.make_body = base_urls, workers, make_body
        self.total, self.deadline_s, self.headers, self.pause_s = total, deadline_s, headers, pause_s
        self.tally = Tally()
        self._stop = threading.Event()
        self._counter = itertools.count()
        self._pool: ThreadPoolExecutor | None = None

    def _worker(self) -> None:
        with httpx.Client() as client:
            while not self._stop.is_set():
                i = next(self._counter)
                if self.total is not None and i >= self.total:
                    return
                url = self.base_urls[i % len(self.base_urls)]
                self.tally.add(send(client, url, self.make_body(i), self.deadline_s, self.headers))
                if self.pause_s:
                    time.sleep(self.pause_s)

    def __enter__(self) -> "Load":
        self._pool = ThreadPoolExecutor(self.workers)
        self._futures = [self._pool.submit(self._worker) for _ in range(self.workers)]
        return self

    def wait_for(self, sent: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tally.sent < sent and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None or self.total is None:
            self._stop.set()
        assert self._pool is not None
        self._pool.shutdown(wait=True)
        for f in self._futures:
            f.result()  # a crashed worker is a bug in the scenario, not a lost request
