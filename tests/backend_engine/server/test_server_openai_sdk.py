"""The official openai SDK pointed at a replica notices nothing unusual."""

import json

from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.backend_engine.server.conftest import MODEL

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


def test_chat_completion_validates_as_sdk_type(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    again = ChatCompletion.model_validate(resp.model_dump())
    assert again.object == "chat.completion" and again.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.system_fingerprint
    usage = resp.usage
    assert usage.completion_tokens <= 6 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_repeated_prompt_reports_cached_tokens(client):
    messages = [{"role": "user", "content": "A prompt long enough to span full blocks " * 4}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    prompt = second.usage.prompt_tokens
    assert first.usage.prompt_tokens == prompt
    assert second.usage.prompt_tokens_details.cached_tokens >= (prompt - 1) // 16 * 16 > 0


def test_raw_response_headers(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert raw.headers["content-type"].startswith("application/json")
    completion = raw.parse()
    assert raw.headers["x-request-id"] == completion.id
    assert completion._request_id == completion.id


def test_client_request_id_becomes_response_id(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"request_id": "abc123"})
    assert resp.id == "chatcmpl-abc123"


def test_streaming_chunk_order_and_usage_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    for c in chunks:
        ChatCompletionChunk.model_validate(c.model_dump())
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    finish = chunks[-2]
    assert finish.choices[0].finish_reason in ("stop", "length") and finish.choices[0].delta.content is None
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    usage_chunk = chunks[-1]
    # a token whose text is held back (part of a character, or nothing printable) sends no chunk
    # of its own (~1 request in 20 here samples one), so usage counts at least the content chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens >= len(chunks) - 3
    if finish.choices[0].finish_reason == "length":
        assert usage_chunk.usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_wire_format(http):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert "usage" not in payloads[0]  # only present (as null) when include_usage is set
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0]["delta"] == {}


def test_streamed_text_equals_non_streamed_text(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == whole


def test_stop_string_never_leaks_into_stream(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    words = text.split()
    stop = words[len(words) // 2] if len(words) > 1 else text[2:5]
    assert stop and stop in text
    streamed = list(client.chat.completions.create(**kwargs, stop=[stop], stream=True))
    joined = "".join(c.choices[0].delta.content or "" for c in streamed)
    assert stop not in joined and joined == text[: text.index(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"
    whole = client.chat.completions.create(**kwargs, stop=stop)
    assert whole.choices[0].message.content == joined and whole.choices[0].finish_reason == "stop"


def test_n_choices_interleave_by_index_each_with_finish(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=3, stream=True, seed=1))
    per_index: dict[int, list] = {0: [], 1: [], 2: []}
    for c in chunks:
        assert len(c.choices) == 1
        per_index[c.choices[0].index].append(c.choices[0])
    for choices in per_index.values():
        assert choices[0].delta.role == "assistant"
        assert [ch.finish_reason is not None for ch in choices].count(True) == 1 and choices[-1].finish_reason
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=3)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    if all(c.finish_reason == "length" for c in resp.choices):
        assert resp.usage.completion_tokens == 12  # summed over the n choices
    assert resp.usage.completion_tokens <= 12


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and t.bytes == list(t.token.encode()) for t in content)


async def test_async_client_stream_and_not(aclient):
    resp = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert isinstance(resp, ChatCompletion)
    stream = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason


def test_completions_text_tokens_and_lists(client):
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0)
    Completion.model_validate(resp.model_dump())
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    many = client.completions.create(model=MODEL, prompt=["One", "Two two"], max_tokens=3, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    ids = client.completions.create(model=MODEL, prompt=[[1, 2, 3, 4], [5, 6, 7]], max_tokens=2)
    assert ids.usage.prompt_tokens == 7


def test_completions_echo_and_logprobs(client):
    echoed = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, echo=True, temperature=0)
    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    assert echoed.choices[0].text == "Hello there" + plain.choices[0].text
    resp = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, logprobs=2, temperature=0)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == resp.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == resp.choices[0].text


def test_completions_stream_with_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Count:", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert all(c.object == "text_completion" for c in chunks)


def test_models_list_and_retrieve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    Model.model_validate(models.data[0].model_dump())
    assert client.models.retrieve(MODEL).id == MODEL


def test_tokenize_matches_chat_prompt(http, client):
    tok = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert tok["count"] == len(tok["tokens"]) == resp.usage.prompt_tokens
    plain = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert len(plain["token_strs"]) == plain["count"]
    back = http.post("/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back["prompt"].endswith("hello world")


def test_health_ready(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ready"


def test_unknown_route_is_openai_404(http):
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_completions_stream_many_prompts_each_choice_finishes_once(client):
    chunks = list(client.completions.create(model=MODEL, prompt=["One", "Two two"], max_tokens=3, n=2, stream=True))
    finishes = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2, 3]
    texts: dict[int, str] = {}
    for c in chunks:
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert set(texts) == {0, 1, 2, 3}


def test_chat_stream_logprobs_per_delta(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True,
                                                 logprobs=True, top_logprobs=1, stream_options={"include_usage": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens
    assert all(len(e.top_logprobs) == 1 for e in entries)
