"""Stall detection on a silent stream: the gateway keeps waiting while the replica says the
request advances or is queued, and gives up (a stall) when it says nothing in time, does not know
the request, says it finished, or says it runs without advancing; always by read_timeout_s."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gateway.migration import Interrupted, next_chunk
from gateway.stall_probe import SilenceWatch, is_alive, replica_probe

STALL_S = 0.1


@pytest.mark.parametrize(("answer", "alive"), [
    ({"state": "running", "since_progress_s": 0.02}, True),
    ({"state": "running", "since_progress_s": 0.5}, False),  # scheduled, not advancing: stuck
    ({"state": "preempted", "since_progress_s": 9.0}, True),  # queued for blocks on a live replica
    ({"state": "waiting", "since_progress_s": 9.0}, True),
    ({"state": "finished", "since_progress_s": 0.0}, False),  # its bytes never came
    ({"state": "running"}, False),
    (None, False),  # no answer in time, unknown id, or no such endpoint
])
def test_what_a_replica_says_of_a_silent_request_decides(answer, alive):
    assert is_alive(answer, STALL_S) is alive


async def _silent_then(data: bytes, silent_s: float):
    await asyncio.sleep(silent_s)
    yield data


def _probe(answer: dict | None, asked: list[float]):
    async def probe() -> dict | None:
        asked.append(time.monotonic())
        return answer
    return probe


async def test_a_silent_stream_whose_request_advances_is_waited_for():
    asked: list[float] = []
    watch = SilenceWatch(STALL_S, 30.0, _probe({"state": "running", "since_progress_s": 0.01}, asked))
    notice = asyncio.get_running_loop().create_future()
    assert await next_chunk(_silent_then(b"data: x\n\n", 0.5), notice, watch) == b"data: x\n\n"
    assert len(asked) >= 2  # asked again after each further stall timeout of silence


@pytest.mark.parametrize("answer", [None, {"state": "running", "since_progress_s": 5.0},
                                    {"state": "finished", "since_progress_s": 0.0}])
async def test_a_silent_stream_the_replica_does_not_account_for_stalls(answer):
    asked: list[float] = []
    watch = SilenceWatch(STALL_S, 30.0, _probe(answer, asked))
    notice = asyncio.get_running_loop().create_future()
    t0 = time.monotonic()
    with pytest.raises(Interrupted) as caught:
        await next_chunk(_silent_then(b"late", 5.0), notice, watch)
    assert caught.value.cause == "stall" and len(asked) == 1
    assert time.monotonic() - t0 < 1.0


async def test_a_queued_request_is_waited_for_up_to_the_read_timeout():
    asked: list[float] = []
    watch = SilenceWatch(STALL_S, 0.45, _probe({"state": "preempted", "since_progress_s": 3.0}, asked))
    notice = asyncio.get_running_loop().create_future()
    t0 = time.monotonic()
    with pytest.raises(Interrupted):
        await next_chunk(_silent_then(b"late", 5.0), notice, watch)
    assert 0.4 < time.monotonic() - t0 < 1.5 and len(asked) >= 3


async def test_without_a_probe_silence_alone_is_a_stall():
    notice = asyncio.get_running_loop().create_future()
    with pytest.raises(Interrupted):
        await next_chunk(_silent_then(b"late", 5.0), notice, SilenceWatch(STALL_S, 30.0))


def _client(handler) -> httpx.AsyncClient:  # noqa: ANN001
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_the_probe_asks_for_the_response_id_and_reads_the_answer():
    seen: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path.decode())
        if seen[-1].endswith("/chatcmpl-a%2Fb"):
            return httpx.Response(200, json={"state": "running", "since_progress_s": 0.1})
        return httpx.Response(404, json={"error": {"message": "no", "type": "invalid_request_error",
                                                   "param": None, "code": "not_found"}})

    async with _client(handler) as client:
        named = httpx.Response(200, headers={"x-request-id": "chatcmpl-a/b"})
        assert await replica_probe(client, "http://r", named, 1.0)() == \
            {"state": "running", "since_progress_s": 0.1}
        unknown = httpx.Response(200, headers={"x-request-id": "other"})
        assert await replica_probe(client, "http://r", unknown, 1.0)() is None  # 404: vLLM's too
        assert replica_probe(client, "http://r", httpx.Response(200), 1.0) is None  # no id: no probe
    assert seen == ["/v1/requests/chatcmpl-a%2Fb", "/v1/requests/other"]


async def test_a_probe_that_gets_no_answer_in_time_counts_as_none():
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200, json={"state": "running", "since_progress_s": 0.0})

    async with _client(handler) as client:
        t0 = time.monotonic()
        named = httpx.Response(200, headers={"x-request-id": "x"})
        assert await replica_probe(client, "http://r", named, 0.2)() is None
        assert time.monotonic() - t0 < 1.0
