"""Request bodies → pydantic models, with pydantic's errors turned into one OpenAI 400 that names
the offending field as a clean dotted path (`messages[0].content`), as vLLM's clean_loc_for_param."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from protocol.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)

_PYDANTIC_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


def _is_internal(part: str) -> bool:
    """Loc parts pydantic adds for union members and validators, not field names."""
    return (
        part in _PYDANTIC_TYPE_NAMES
        or part[:1].isupper()
        or any(c in part for c in "[](),-")
    )


_FASTAPI_SOURCES = {"body", "query", "path", "header", "cookie"}


def param_from_loc(loc: Sequence[int | str]) -> str | None:
    out = ""
    if loc and loc[0] in _FASTAPI_SOURCES:
        loc = loc[1:]
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_internal(part):
            out += f".{part}" if out else part
    return out or None


def _describe(err: dict) -> str:
    msg = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        return "Unrecognized request argument supplied"
    if err.get("type") == "missing":
        return "Missing required parameter"
    return msg[0].lower() + msg[1:] if msg else msg


def validation_error_to_api_error(exc: ValidationError | Sequence[dict]) -> APIError:
    errors = exc.errors() if isinstance(exc, ValidationError) else list(exc)
    if not errors:
        return bad_request("Invalid request body")
    # With unions pydantic reports one error per member; the deepest loc is the most specific.
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    if any(e.get("type") == "missing" for e in errors):
        first = next(e for e in errors if e.get("type") == "missing")
    param = param_from_loc(first.get("loc", ()))
    what = _describe(first)
    message = f"Invalid parameter '{param}': {what}." if param else f"Invalid request: {what}."
    if first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif first.get("type") == "missing":
        message = f"Missing required parameter: '{param}'."
    codes = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}
    return bad_request(message, param=param, code=codes.get(first.get("type", ""), "invalid_value"))


def parse_json_body(raw: bytes) -> dict:
    """Decode a JSON object body or raise the OpenAI 400 for malformed JSON."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise bad_request(
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
            "using your HTTP library correctly. The OpenAI API expects a JSON payload.)",
            code="invalid_json",
        ) from None
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise bad_request("The JSON body of your request is nested too deeply.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return data


def parse_request(model_cls: type[M], raw: bytes | dict) -> M:
    """Validate a request body (bytes or an already decoded dict) into `model_cls`."""
    data = parse_json_body(raw) if isinstance(raw, (bytes, bytearray, str)) else raw
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error_to_api_error(exc) from None
