"""A request's structured-output fields (`response_format`, vLLM's `structured_outputs`) as the
engine's StructuredOutputsParams, naming the request field its errors should point at."""

from __future__ import annotations

from backend_engine.errors import InvalidRequestError
from backend_engine.server.sampling import engine_error_to_api
from backend_engine.structured import StructuredOutputsParams
from kvgate.protocol.structured import ResponseFormat, StructuredOutputs


def response_schema(fmt: ResponseFormat | None) -> tuple[dict | None, str]:
    """The JSON Schema a response format asks for (None: free text), and its field name."""
    if fmt is None or fmt.type == "text":
        return None, "response_format"
    if fmt.type == "json_object":
        return {"type": "object"}, "response_format"
    return fmt.json_schema.json_schema or {}, "response_format.json_schema.schema"


def structured_params(fmt: ResponseFormat | None,
                      extra: StructuredOutputs | None) -> StructuredOutputsParams | None:
    """The constraint of a request without forced tool calls (None: unconstrained)."""
    try:
        if extra is not None:
            return StructuredOutputsParams(**extra.constraint(), param="structured_outputs")
        schema, param = response_schema(fmt)
        if schema is None:
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True, param=param)
        return StructuredOutputsParams(json=schema, param=param)
    except InvalidRequestError as exc:
        raise engine_error_to_api(exc) from None
