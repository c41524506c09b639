"""What a request constrains its output to (vLLM's StructuredOutputsParams): exactly one of a
JSON Schema, any JSON object, a regex, a list of choices, an EBNF grammar, or an xgrammar
structural tag (how forced tool calls are written)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from backend_engine.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 256 * 1024  # a larger schema or grammar is refused, not compiled


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    json: str | dict | bool | None = None  # a JSON Schema (object, serialised object or bool)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF, as xgrammar (and llama.cpp's GBNF) read it
    structural_tag: str | dict | None = None  # {"type": "structural_tag", "format": {...}}
    # JSON's whitespace (json, json_object, structural tags): none, as OpenAI writes it, or
    # with this off at most a space or a newline and bounded indentation per gap (vLLM's name)
    disable_any_whitespace: bool = True
    # the request field errors should name (e.g. "response_format.json_schema.schema")
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured outputs need exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) or 'none'}", param=self.param, code="invalid_value")
        if self.choice is not None and (not self.choice or
                                        not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("'choice' must be a non-empty list of non-empty strings",
                                      param=self.param, code="invalid_value")
        if len(self.spec_text) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"the {self.kind} is too large (over {MAX_SPEC_CHARS} "
                                      "characters)", param=self.param, code="invalid_value")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec_text(self) -> str:
        """The constraint as text: what is compiled, and (with the kind) the cache key."""
        kind = self.kind
        if kind in ("json", "structural_tag"):
            value: Any = getattr(self, kind)
            return value if isinstance(value, str) else json.dumps(value)
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(list(self.choice), ensure_ascii=False)
        return getattr(self, kind)

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.kind, self.spec_text, self.disable_any_whitespace
