"""`return_token_ids` and `resume_token_ids` (the gateway's mid-stream migration): a stream cut
after any engine output and resumed on the tokens it had sent gives, spliced, exactly the
uninterrupted stream — text, tool calls, stop strings and grammars across the seam, one finish,
usage counting each token once."""

from __future__ import annotations

import json

import pytest

from tests.backend_engine.server.conftest import MODEL
from tests.backend_engine.server.test_server_structured import TOOLS

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say something long."}],
        "temperature": 0, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True}}


def events(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: {")]


def groups(chunks: list[dict]) -> list[list[dict]]:
    """The choice chunks of each engine output: each group ends with the chunk carrying ids."""
    out, current = [], []
    for c in chunks:
        if not c["choices"] or c["choices"][0].get("delta", {}).get("role"):
            continue
        current.append(c)
        if "token_ids" in c["choices"][0]:
            out.append(current)
            current = []
    assert not current  # every output's chunks end with its ids
    return out


def assemble(chunks: list[dict]) -> dict:
    """What a client reads from choice chunks: text, tool calls by index, finish reasons."""
    text, calls, finishes = "", {}, []
    for c in chunks:
        for choice in c["choices"]:
            delta = choice.get("delta", {})
            text += delta.get("content") or choice.get("text") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += (call.get("function") or {}).get("name") or ""
                entry["arguments"] += (call.get("function") or {}).get("arguments") or ""
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
    return {"text": text, "calls": calls, "finishes": finishes}


def check_every_seam(http, path: str, body: dict, seams: int = 4) -> None:
    whole = events(http, path, body)
    usage = whole[-1]["usage"]
    outputs = groups(whole)
    ids = [t for g in outputs for c in g for t in c["choices"][0].get("token_ids", [])]
    assert usage["completion_tokens"] == len(ids) and len(outputs) > seams
    expected = assemble([c for g in outputs for c in g])
    assert len(expected["finishes"]) == 1
    step = max(1, (len(outputs) - 1) // seams)
    for cut in range(1, len(outputs) - 1, step):
        sent = [c for g in outputs[:cut] for c in g]
        resumed_ids = [t for c in sent for t in c["choices"][0].get("token_ids", [])]
        rest = events(http, path, {**body, "resume_token_ids": resumed_ids})
        assert rest[-1]["usage"]["completion_tokens"] == usage["completion_tokens"]
        assert rest[-1]["usage"]["prompt_tokens"] == usage["prompt_tokens"]
        spliced = assemble(sent + [c for g in groups(rest) for c in g])
        assert spliced == expected, f"seam after output {cut}"


def test_completion_resumed_after_any_output_is_the_uninterrupted_text(http):
    check_every_seam(http, "/v1/completions", {
        "model": MODEL, "prompt": "once upon a time", "max_tokens": 24, "temperature": 0,
        "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}})


def test_stop_string_spanning_the_seam_still_stops(http):
    plain = http.post("/v1/completions", json={"model": MODEL, "prompt": "a story", "max_tokens": 30,
                                               "temperature": 0}).json()["choices"][0]["text"]
    stop = plain[12:18]  # ends the text where it is cut, wherever the seam falls before it
    check_every_seam(http, "/v1/completions", {
        "model": MODEL, "prompt": "a story", "max_tokens": 30, "temperature": 0, "stop": [stop],
        "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}, seams=3)


def test_json_schema_grammar_is_advanced_over_the_resumed_tokens(http):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    check_every_seam(http, "/v1/chat/completions", {
        **CHAT, "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})


def test_forced_tool_call_parses_across_the_seam(http):
    check_every_seam(http, "/v1/chat/completions", {
        **CHAT, "max_tokens": 80, "tools": TOOLS, "tool_choice": "required"})


def test_resume_past_the_length_limit_ends_at_once(http):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "temperature": 0}
    full = http.post("/v1/completions", json={**body, "return_token_ids": True}).json()
    ids = full["choices"][0]["token_ids"]
    again = http.post("/v1/completions", json={**body, "resume_token_ids": ids}).json()
    assert again["choices"][0]["finish_reason"] == "length"
    assert again["choices"][0]["text"] == full["choices"][0]["text"]
    assert again["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("extra", [{"n": 2}, {"resume_token_ids": []}, {"prompt": ["a", "b"]}])
def test_bad_resume_requests_are_refused(http, extra):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "resume_token_ids": [5, 6], **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "resume_token_ids"


def test_resume_ids_outside_the_vocabulary_are_refused(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "resume_token_ids": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "resume_token_ids"
