"""Structured outputs at the HTTP edge: OpenAI's `response_format`, vLLM's `structured_outputs`
extra, and a light check of JSON Schemas both edges run (the replica's grammar compiler has the
last word on what it supports)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from protocol.common import StrictModel
from protocol.errors import bad_request

SCHEMA_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
MAX_SCHEMA_DEPTH = 64
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def check_json_schema(schema: Any, param: str, depth: int = 0) -> None:
    """400 naming the offending place if `schema` is not a well-formed JSON Schema."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON Schema object.", param, "invalid_value")
    if depth > MAX_SCHEMA_DEPTH:
        raise bad_request(f"'{param}' is nested too deeply.", param, "invalid_value")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in SCHEMA_TYPES for k in kinds):
        raise bad_request(f"'{param}.type' must be one of {sorted(SCHEMA_TYPES)} (or a list of "
                          "them).", f"{param}.type", "invalid_value")
    required = schema.get("required")
    if required is not None and not (isinstance(required, list)
                                     and all(isinstance(r, str) for r in required)):
        raise bad_request(f"'{param}.required' must be a list of property names.",
                          f"{param}.required", "invalid_value")
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        raise bad_request(f"'{param}.enum' must be a non-empty list.", f"{param}.enum",
                          "invalid_value")
    for key in _SUBSCHEMA_LISTS:
        if key in schema:
            items = schema[key]
            if not isinstance(items, list) or not items:
                raise bad_request(f"'{param}.{key}' must be a non-empty list of schemas.",
                                  f"{param}.{key}", "invalid_value")
            for i, sub in enumerate(items):
                check_json_schema(sub, f"{param}.{key}[{i}]", depth + 1)
    for key in _SUBSCHEMA_MAPS:
        if key in schema:
            mapping = schema[key]
            if not isinstance(mapping, dict):
                raise bad_request(f"'{param}.{key}' must map names to schemas.",
                                  f"{param}.{key}", "invalid_value")
            for name, sub in mapping.items():
                check_json_schema(sub, f"{param}.{key}.{name}", depth + 1)
    for key in _SUBSCHEMAS:
        if key in schema:
            check_json_schema(schema[key], f"{param}.{key}", depth + 1)


class JSONSchemaFormat(StrictModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """`response_format` of chat completions: text, any JSON object, or a JSON Schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema":
            if self.json_schema is None:
                raise bad_request("Missing required parameter: 'response_format.json_schema'.",
                                  "response_format.json_schema", "missing_required_parameter")
            check_json_schema(self.json_schema.json_schema or {},
                              "response_format.json_schema.schema")
        elif self.json_schema is not None:
            raise bad_request("'response_format.json_schema' is only allowed with type "
                              "'json_schema'.", "response_format.json_schema", "invalid_value")
        return self


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` request extra: exactly one constraint, and options; options
    alone (say `disable_any_whitespace`) tune the constraint `response_format` asks for."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_schema: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # None: the server's setting

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [name for name, value in self.constraint().items()]
        if len(given) != 1 and (given or self.disable_any_whitespace is None):
            raise bad_request("'structured_outputs' takes exactly one of json, regex, choice, "
                              f"grammar, json_object (got {', '.join(given) or 'none'}).",
                              "structured_outputs", "invalid_value")
        if isinstance(self.json_schema, dict):
            check_json_schema(self.json_schema, "structured_outputs.json")
        if self.choice is not None and not all(self.choice):
            raise bad_request("'structured_outputs.choice' must hold non-empty strings.",
                              "structured_outputs.choice", "invalid_value")
        return self

    @property
    def has_constraint(self) -> bool:
        return bool(self.constraint())

    def constraint(self) -> dict[str, Any]:
        """The one constraint given, with vLLM's field names."""
        values = {"json": self.json_schema, "regex": self.regex, "choice": self.choice,
                  "grammar": self.grammar, "json_object": self.json_object or None}
        return {k: v for k, v in values.items() if v is not None}
