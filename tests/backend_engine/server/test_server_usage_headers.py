"""A replica's response headers carry its prompt usage (tokens, and those served from the prefix
cache), known when the headers go out with the first output: the same figures as the body's
`usage`, streamed or not, chat or completions; a proxy reads them without the body."""

from __future__ import annotations

import json

from protocol.usage_headers import (CACHED_TOKENS_HEADER, PROMPT_TOKENS_HEADER, usage_from_headers,
                                    usage_headers)
from tests.backend_engine.server.conftest import MODEL


def _header_usage(headers) -> tuple[int, int]:
    return int(headers[PROMPT_TOKENS_HEADER]), int(headers[CACHED_TOKENS_HEADER])


def test_headers_say_what_the_body_usage_says(http):
    prompt = "the same long prefix, twice over " * 6
    for i, stream in enumerate((False, True, False)):  # the later two find the prefix cached
        body = {"model": MODEL, "prompt": prompt + str(i), "max_tokens": 2, "temperature": 0}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/completions", json=body) as r:
                headers = r.headers
                frames = [f[6:] for f in r.read().decode().split("\n\n") if f.startswith("data: {")]
            usage = json.loads(frames[-1])["usage"]
        else:
            r = http.post("/v1/completions", json=body)
            headers, usage = r.headers, r.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        assert _header_usage(headers) == (usage["prompt_tokens"], cached)
        if i:
            assert cached > 0


def test_several_choices_count_their_prompt_once_and_several_prompts_each(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 2, "n": 2}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert _header_usage(r.headers)[0] == r.json()["usage"]["prompt_tokens"]
    body = {"model": MODEL, "prompt": ["one prompt", "and another one"], "max_tokens": 2}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert _header_usage(r.headers)[0] == r.json()["usage"]["prompt_tokens"]


def test_an_error_carries_no_usage(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and PROMPT_TOKENS_HEADER not in r.headers


def test_only_counts_are_read_back():
    assert usage_from_headers(usage_headers(120, 64)) == (120, 64)
    assert usage_from_headers({}) is None
    for prompt, cached in (("12", "x"), ("-1", "0"), ("10", "11"), ("1e3", "0"), ("", "0")):
        assert usage_from_headers({PROMPT_TOKENS_HEADER: prompt, CACHED_TOKENS_HEADER: cached}) is None
