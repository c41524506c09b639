"""The shared HTTP glue: error handlers (never 422, never a traceback), body limit, SSE framing."""

import json

from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from protocol.chat import ChatCompletionChunk, ChatChunkChoice, DeltaMessage
from protocol.errors import APIError, model_not_found, service_unavailable
from protocol.http import BodySizeLimitMiddleware, install_error_handlers
from protocol.sse import DONE, sse_data, sse_error


class Body(BaseModel):
    x: int


def make_app(limit: int = 1000) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=limit)

    @app.post("/typed")
    async def typed(body: Body) -> dict:
        return {"x": body.x}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("internal secret")

    @app.get("/busy")
    async def busy() -> dict:
        raise service_unavailable("busy", 7, "engine_overloaded")

    @app.get("/missing")
    async def missing() -> dict:
        raise model_not_found("gpt-x")

    return app


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_fastapi_validation_is_400_with_param():
    client = TestClient(make_app())
    r = client.post("/typed", json={"x": "not a number"})
    assert r.status_code == 400 and error_of(r)["param"] == "x"


def test_unhandled_error_is_500_without_details():
    client = TestClient(make_app(), raise_server_exceptions=False)
    r = client.get("/boom")
    assert r.status_code == 500
    err = error_of(r)
    assert err["type"] == "server_error" and "secret" not in r.text and "Traceback" not in r.text


def test_api_errors_carry_status_and_headers():
    client = TestClient(make_app())
    r = client.get("/busy")
    assert r.status_code == 503 and r.headers["retry-after"] == "7" and error_of(r)["code"] == "engine_overloaded"
    r = client.get("/missing")
    assert r.status_code == 404 and error_of(r) == {
        "message": "The model `gpt-x` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    r = client.get("/nowhere")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"


def test_body_limit_413_by_length_and_by_stream():
    client = TestClient(make_app(limit=100))
    r = client.post("/typed", content=b'{"x": 1}' + b" " * 200, headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"

    def chunked():
        yield b'{"x": 1'
        yield b" " * 200
        yield b"}"

    r = client.post("/typed", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.post("/typed", json={"x": 3}).json() == {"x": 3}


def test_sse_framing():
    assert sse_data({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"
    frame = sse_error(APIError(400, "bad", param="n"))
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[6:]) == {"error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}


def test_chunk_deltas_serialise_like_openai():
    def dumped(delta: DeltaMessage, **kw) -> dict:
        chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[ChatChunkChoice(index=0, delta=delta)])
        return json.loads(sse_data(chunk, **kw)[6:])

    assert dumped(DeltaMessage(role="assistant", content=""))["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert dumped(DeltaMessage(content="x"))["choices"][0]["delta"] == {"content": "x"}
    assert dumped(DeltaMessage())["choices"][0]["delta"] == {}
    with_usage = dumped(DeltaMessage())
    assert "usage" in with_usage and with_usage["usage"] is None
    assert "usage" not in dumped(DeltaMessage(), exclude={"usage"})
