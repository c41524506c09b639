"""The splice of a migrating stream, on hand-made SSE bytes: an engine output's chunks reach the
client only with the chunk carrying its token ids, so a break mid-output loses nothing the ids
do not cover; a continuation's role chunk is dropped and its id made the first leg's."""

from __future__ import annotations

import json

import pytest

from gateway.stream_splice import ReplicaErrorEvent, StreamSplice
from protocol.sse import DONE


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chunk(id_: str, content: str | None = None, ids: list[int] | None = None, role: bool = False,
          finish: str | None = None) -> bytes:
    delta = {"role": "assistant", "content": ""} if role else \
        ({"content": content} if content is not None else {})
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return event({"id": id_, "object": "chat.completion.chunk", "created": 1, "model": "m",
                  "choices": [choice]})


def decoded(events: list[bytes]) -> list[dict | str]:
    return [e.decode() if e == DONE else json.loads(e[6:]) for e in events]


def test_an_outputs_chunks_wait_for_its_token_ids_and_lose_them_when_the_leg_breaks():
    splice = StreamSplice(keep_token_ids=False, include_usage=False, prompt_tokens=5)
    sent = splice.feed(chunk("a", role=True) + chunk("a", "Hel", [1]) + chunk("a", "lo"))
    assert [e["choices"][0]["delta"] for e in decoded(sent)] == [
        {"role": "assistant", "content": ""}, {"content": "Hel"}]
    assert "token_ids" not in decoded(sent)[1]["choices"][0]  # the client did not ask for them
    assert splice.token_ids == [1]
    splice.next_leg()  # "lo" never reached the client: the continuation sends it again
    sent = splice.feed(chunk("b", role=True) + chunk("b", "lo", [2, 3]) + chunk("b", "", [4], finish="length"))
    out = decoded(sent)
    assert [e["choices"][0]["delta"] for e in out] == [{"content": "lo"}, {"content": ""}]
    assert {e["id"] for e in out} == {"a"}  # the continuation speaks as the first leg
    assert splice.token_ids == [1, 2, 3, 4] and splice.finished


def test_event_split_across_reads_and_token_ids_kept_when_asked():
    splice = StreamSplice(keep_token_ids=True, include_usage=False, prompt_tokens=5)
    raw = chunk("a", "x", [7])
    assert splice.feed(raw[:10]) == []
    assert splice.feed(raw[10:]) == [raw]  # passed on byte for byte
    assert splice.feed(DONE) == [DONE] and splice.done


def test_error_event_from_the_replica_is_raised_with_its_code():
    splice = StreamSplice(keep_token_ids=False, include_usage=False, prompt_tokens=5)
    with pytest.raises(ReplicaErrorEvent) as err:
        splice.feed(event({"error": {"message": "bye", "code": "server_shutting_down"}}))
    assert err.value.code == "server_shutting_down"


def test_a_stream_broken_after_its_finish_is_closed_with_the_usage_the_gateway_counted():
    splice = StreamSplice(keep_token_ids=False, include_usage=True, prompt_tokens=5)
    splice.feed(chunk("a", role=True) + chunk("a", "hi", [1, 2], finish="stop"))
    assert splice.finished and not splice.done
    closing = decoded(splice.closing_events())
    assert closing[0]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert closing[0]["id"] == "a" and closing[0]["choices"] == [] and closing[1] == DONE.decode()


def test_a_chunk_that_only_carries_ids_is_not_passed_on():
    splice = StreamSplice(keep_token_ids=False, include_usage=False, prompt_tokens=5)
    assert splice.feed(chunk("a", "", [9])) == [] and splice.token_ids == [9]
    kept = StreamSplice(keep_token_ids=True, include_usage=False, prompt_tokens=5)
    assert len(kept.feed(chunk("a", "", [9]))) == 1
