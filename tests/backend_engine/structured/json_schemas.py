"""Hypothesis strategies for random JSON Schemas whose every valid instance is short, so a
constrained generation always completes within a modest max_tokens, whatever the weights."""

from __future__ import annotations

from hypothesis import strategies as st

NAMES = st.sampled_from(["id", "name", "tags", "score", "ok", "kind", "items", "note", "x"])


def _leaves() -> st.SearchStrategy[dict]:
    short_text = st.text(alphabet="abcxyz -_é", min_size=1, max_size=6)
    integer = st.tuples(st.integers(-50, 50), st.integers(0, 80)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    number = st.tuples(st.integers(-10, 10), st.integers(1, 20)).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]})
    return st.one_of(
        st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
        st.lists(short_text, min_size=1, max_size=4, unique=True).map(
            lambda v: {"type": "string", "enum": v}),
        st.sampled_from(["[a-z]{1,5}", "[0-9]{2}-[A-Z]", "(yes|no)"]).map(
            lambda p: {"type": "string", "pattern": f"^{p}$"}),
        integer, number,
        st.just({"type": "boolean"}), st.just({"type": "null"}),
        short_text.map(lambda v: {"const": v}),
        st.just({"type": ["integer", "null"], "minimum": 0, "maximum": 9}),
    )


def _extend(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    def obj(props: dict, required_mask: list[bool]) -> dict:
        names = list(props)
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [n for n, r in zip(names, required_mask) if r]}

    objects = st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
            lambda mask: obj(props, mask)))
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    unions = st.lists(children, min_size=2, max_size=3).map(lambda c: {"anyOf": c})
    return st.one_of(objects, arrays, unions)


def json_schemas(max_leaves: int = 8) -> st.SearchStrategy[dict]:
    """A random schema whose root is an object (as response_format json_schema wants)."""
    inner = st.recursive(_leaves(), _extend, max_leaves=max_leaves)
    return st.dictionaries(NAMES, inner, min_size=1, max_size=4).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})
