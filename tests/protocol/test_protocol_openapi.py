"""Both HTTP edges publish an OpenAPI document that describes the request bodies their routes
parse themselves, so schema-based tools (clients, schemathesis) see the real fields."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from gateway.app import create_app
from gateway.config import GatewayConfig
from protocol.errors import APIError
from protocol.parsing import parse_json_body


def test_gateway_document_names_the_request_models():
    doc = create_app(GatewayConfig(replicas=[], admin_key="k")).openapi()
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{model}"}
        assert "model" in doc["components"]["schemas"][model]["properties"]
    assert "ChatMessage" in doc["components"]["schemas"]  # nested models are there too
    operation = schemathesis.openapi.from_dict(doc)["/v1/chat/completions"]["POST"]

    @settings(max_examples=5, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def generated(case) -> None:  # noqa: ANN001
        assert isinstance(case.body, dict) and "messages" in case.body

    generated()


def test_deeply_nested_json_is_a_400_not_a_crash():
    with pytest.raises(APIError) as error:
        parse_json_body(b'{"prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert error.value.status_code == 400 and error.value.code == "invalid_json"
