"""A request's structured-output fields (`response_format`, vLLM's `structured_outputs`) as the
engine's StructuredOutputsParams, naming the request field its errors should point at, with the
JSON whitespace policy (`--structured-outputs-config`, overridden per request)."""

from __future__ import annotations

from backend_engine.errors import InvalidRequestError
from backend_engine.server.sampling import engine_error_to_api
from backend_engine.structured import StructuredOutputsParams
from protocol.structured import ResponseFormat, StructuredOutputs


CHAT_SCHEMA_PARAM = "response_format.json_schema.schema"


def response_schema(fmt: ResponseFormat | None) -> dict | None:
    """The JSON Schema a response format asks for (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    return fmt.json_schema.json_schema or {}


def disable_any_whitespace(default: bool, extra: StructuredOutputs | None) -> bool:
    """The request's JSON whitespace policy: its own `structured_outputs` option, else the
    server's."""
    if extra is not None and extra.disable_any_whitespace is not None:
        return extra.disable_any_whitespace
    return default


def structured_params(fmt: ResponseFormat | None, extra: StructuredOutputs | None,
                      schema_param: str = CHAT_SCHEMA_PARAM, compact: bool = True
                      ) -> StructuredOutputsParams | None:
    """The constraint of a request without forced tool calls (None: unconstrained);
    `schema_param` names the schema's field in errors; `compact`: disable_any_whitespace."""
    try:
        if extra is not None and extra.has_constraint:
            return StructuredOutputsParams(**extra.constraint(), param="structured_outputs",
                                           disable_any_whitespace=compact)
        schema = response_schema(fmt)
        if schema is None:
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True, param="response_format",
                                           disable_any_whitespace=compact)
        return StructuredOutputsParams(json=schema, param=schema_param,
                                       disable_any_whitespace=compact)
    except InvalidRequestError as exc:
        raise engine_error_to_api(exc) from None
