"""`GET /v1/requests/{id}`: what the gateway asks of a silent stream — the request's state in the
engine by its response id, running and advancing while it streams, 404 once it has ended or for
an id the replica never served."""

from __future__ import annotations

import json
import time

from backend_engine.engine import LLMEngine
from tests.backend_engine.server.conftest import MODEL


def test_a_streaming_request_reports_running_and_advancing(http, replica, monkeypatch):
    step = LLMEngine.step

    def slow_step(self):  # noqa: ANN001, ANN202 - a replica under a heavy batch
        time.sleep(0.03)
        return step(self)

    monkeypatch.setattr(replica.engine.engine, "step", slow_step.__get__(replica.engine.engine))
    body = {"model": MODEL, "prompt": "count", "max_tokens": 40, "ignore_eos": True,
            "temperature": 0, "stream": True}
    answers = []
    with http.stream("POST", "/v1/completions", json=body) as r:
        response_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: {") and len(answers) < 2:
                assert json.loads(line[6:])["id"] == response_id
                answers.append(http.get(f"/v1/requests/{response_id}").json())
    for answer in answers:
        assert answer["id"] == response_id and answer["object"] == "request.state"
        assert answer["state"] == "running" and answer["since_progress_s"] < 1.0
        assert answer["num_prompt_tokens"] > 0 and answer["num_preemptions"] == 0
    assert answers[1]["num_computed_tokens"] > answers[0]["num_computed_tokens"]
    assert answers[1]["num_output_tokens"] > answers[0]["num_output_tokens"]
    gone = http.get(f"/v1/requests/{response_id}")  # ended: nothing in flight by that id
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"


def test_an_unknown_request_id_is_a_404_in_openai_format(http):
    r = http.get("/v1/requests/chatcmpl-never-served")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "chatcmpl-never-served" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
