"""Schema-based fuzzing with schemathesis: requests generated from a server's own OpenAPI
document, valid and invalid ones, sent to the live server. Whatever comes back must not be a
5xx, and every error must be the API's error object (OpenAI's; Anthropic's on /v1/messages)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable

from benchmarks.reliability.load import is_openai_error
from benchmarks.reliability.result import ScenarioResult
from protocol.anthropic_errors import is_anthropic_path

# Operations that cost a replica real work get few examples; the rest are cheap.
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/models/{model}",
                "/v1/models/{model_id}", "/tokenize", "/detokenize")
# Anthropic's Messages API: its schema is slow to generate from, so it is fuzzed on its own
MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
EXPENSIVE_FIELDS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 1}


@dataclass(slots=True)
class FuzzTally:
    calls: int = 0
    server_errors: list[str] = field(default_factory=list)  # 5xx
    not_openai_errors: list[str] = field(default_factory=list)  # 4xx without OpenAI's error object


def _bounded(body: object) -> object:
    """Keep generated requests cheap: a valid but huge max_tokens or n would only burn CPU (the
    hand-written bad-input cases send the huge ones)."""
    if isinstance(body, dict):
        for name, cap in EXPENSIVE_FIELDS.items():
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                body[name] = cap
    return body


def is_anthropic_error(payload: object) -> bool:
    if not isinstance(payload, dict) or payload.get("type") != "error":
        return False
    error = payload.get("error")
    return isinstance(error, dict) and {"type", "message"} <= set(error)


def _record(tally: FuzzTally, label: str, status: int, content: bytes, path: str = "") -> None:
    tally.calls += 1
    if status >= 500:
        tally.server_errors.append(f"{label} -> {status}: {content[:200]!r}")
    elif status >= 400:
        check = is_anthropic_error if is_anthropic_path(path) else is_openai_error
        try:
            ok = check(json.loads(content))
        except ValueError:
            ok = False
        if not ok:
            tally.not_openai_errors.append(f"{label} -> {status}: {content[:200]!r}")


def fuzz_server(base_url: str, examples: int, headers: dict[str, str] | None = None,
                paths: tuple[str, ...] = OPENAI_PATHS) -> FuzzTally:
    """`examples` valid and `examples` invalid requests per operation of the server's document."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    tally = FuzzTally()
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path not in paths:
            continue
        has_input = len(operation.body) > 0 or any(True for _ in operation.iter_parameters())
        for mode in schemathesis.GenerationMode:
            if mode is schemathesis.GenerationMode.NEGATIVE and not has_input:
                continue  # nothing to make invalid
            _fuzz_operation(operation, mode, base_url, examples, headers or {}, tally)
    return tally


def _fuzz_operation(operation, mode, base_url: str, examples: int, headers: dict[str, str],  # noqa: ANN001
                    tally: FuzzTally) -> None:
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    @seed(random.getrandbits(64))  # an explicit seed: fresh inputs each run, no "reproduce" chatter
    def run(case) -> None:  # noqa: ANN001
        case.body = _bounded(case.body)
        response = case.call(base_url=base_url, headers=headers, timeout=60)
        _record(tally, f"{mode.value} {operation.label}", response.status_code, response.content,
                operation.path)

    try:
        run()
    except Unsatisfiable:  # nothing invalid to send (an operation without parameters)
        pass


def fuzz(gateway_url: str, replica_url: str, examples: int,
         headers: dict[str, str] | None = None,
         paths: tuple[str, ...] = OPENAI_PATHS) -> ScenarioResult:
    result = ScenarioResult("schema fuzzing (schemathesis)")
    for name, url, extra in (("gateway", gateway_url, headers), ("replica", replica_url, None)):
        tally = fuzz_server(url, examples, extra, paths)
        result.sent += tally.calls
        result.failed += len(tally.server_errors)
        result.succeeded += tally.calls - len(tally.server_errors)
        result.notes[f"{name}_5xx"] = tally.server_errors[:5]
        result.notes[f"{name}_not_openai_errors"] = tally.not_openai_errors[:5]
        result.checks[f"{name}: no 5xx"] = not tally.server_errors
        result.checks[f"{name}: every error in its API's format"] = not tally.not_openai_errors
    result.notes["fuzz_5xx"] = result.failed
    return result
