"""A config field's command-line flag, declared beside its default (`setting`), and how one
value of it is read from text, JSON, YAML or Python (`Setting`). cli_args.py builds parsers from
these; config dataclasses import only this module. Torch-free."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class SettingError(argparse.ArgumentTypeError, ValueError):
    """A value no field accepts: argparse reports it against its flag, callers catch a
    ValueError."""


@dataclass(frozen=True, slots=True)
class JsonConfig:
    """One flag taking a JSON object whose keys set several fields (vLLM's --speculative-config)."""

    name: str  # the flag's dest, and the keyword argument LLM() takes the mapping as
    help: str
    group: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True, slots=True)
class Flag:
    help: str
    flag: str | None = None  # None: "--" and the field's name, dashed
    aliases: tuple[str, ...] = ()  # more spellings of the flag ("-tp")
    off_alias: str | None = None  # a bool's extra off switch, accepted but not shown
    choices: tuple[Any, ...] | None = None
    value_aliases: tuple[tuple[str, Any], ...] = ()  # other spellings of values ("kv_producer")
    group: str | None = None  # the argument group's title; None: the command's main options
    exclusive: str | None = None  # fields sharing this name may not be given together
    metavar: str | None = None
    nargs: str | None = None
    parse: Callable[[str], Any] | None = None  # one value from text; None: from the annotation
    json: JsonConfig | None = None  # set through this JSON flag instead of a flag of its own ...
    key: str | None = None  # ... under this key (vLLM's name)
    via: str | None = None  # no flag of its own: how the command line sets it, or "" (Python only)

    @property
    def has_flag(self) -> bool:
        return self.json is None and self.via is None


def setting(default: Any = dataclasses.MISSING, help: str = "", *,  # noqa: A002 - argparse's name
            factory: Callable[[], Any] | None = None, **flag: Any) -> Any:
    """A dataclass field whose metadata describes its flag (see `Flag`)."""
    meta = {"flag": Flag(help, **flag)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class Setting:
    """One field of a config dataclass, with its flag and the type its annotation gives."""

    name: str
    meta: Flag
    kind: type  # int, float, str, bool, list or dict (None stripped from `X | None`)
    optional: bool
    default: Any

    @property
    def flag(self) -> str:
        return self.meta.flag or "--" + self.name.replace("_", "-")

    def parse_text(self, text: str) -> Any:
        if self.optional and self.kind in (int, float) and text.strip().lower() in _NONE:
            return None
        parse = self.meta.parse or {int: int, float: float, bool: _bool}.get(self.kind, str)
        try:
            value = parse(text)
        except ValueError:
            raise SettingError(f"{text!r} is not {_NAMES.get(self.kind, 'valid')}") from None
        return self.canonical(value)

    def canonical(self, value: Any) -> Any:
        value = dict(self.meta.value_aliases).get(value, value) if isinstance(value, str) else value
        if self.meta.choices is not None and value not in self.meta.choices:
            raise SettingError(f"{value!r} is not one of "
                               f"{', '.join(map(str, self.meta.choices))}")
        return value

    def coerce(self, value: Any) -> Any:
        """A value from YAML, JSON or Python: text parsed as the flag would, types checked."""
        if value is None:
            if self.optional or self.default is None:
                return None
            raise ValueError("null is not a value here")
        if isinstance(value, str) and self.kind not in (str, list, dict):
            return self.parse_text(value)
        ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
              float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str),
              list: lambda v: isinstance(v, (list, tuple)), dict: lambda v: isinstance(v, Mapping)}
        if not ok[self.kind](value):
            raise ValueError(f"expected {self.kind.__name__}, got {value!r}")
        if self.kind is dict:
            return {str(k): str(v) for k, v in value.items()}
        if self.kind is list:
            return [str(v) for v in value]
        return self.canonical(float(value) if self.kind is float else value)


_NAMES = {int: "an integer", float: "a number", bool: "true or false"}
_NONE = ("none", "null")  # an optional number's "no value" on the command line


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("true", "false", "on", "off", "1", "0", "yes", "no"):
        raise ValueError(f"{text!r} is not true or false")
    return lowered in ("true", "on", "1", "yes")


def _kind(hint: Any) -> tuple[type, bool]:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    optional = type(None) in args
    if args:
        hint = next(a for a in args if a is not type(None))
    return typing.get_origin(hint) or hint, optional


@functools.cache
def settings(cls: type) -> tuple[Setting, ...]:
    """The fields of `cls` that carry a `Flag`, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "flag" in f.metadata:
            kind, optional = _kind(hints[f.name])
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            out.append(Setting(f.name, f.metadata["flag"], kind, optional, default))
    return tuple(out)


def json_configs(cls: type) -> list[JsonConfig]:
    return list(dict.fromkeys(s.meta.json for s in settings(cls) if s.meta.json))


def json_fields(cls: type, config: JsonConfig) -> dict[str, Setting]:
    """The JSON flag's keys → the fields they set."""
    return {s.meta.key or s.name: s for s in settings(cls) if s.meta.json == config}


def expand_json(cls: type, config: JsonConfig, obj: Any, label: str = "") -> dict[str, Any]:
    """A JSON config's object → field values; a key or value no field takes is refused (the
    message starts with `label`, where the caller's context does not name the config)."""
    prefix = f"{label}: " if label else ""
    if not isinstance(obj, Mapping):
        raise SettingError(f"{prefix}expected a JSON object, not {obj!r}")
    keys = json_fields(cls, config)
    unknown = sorted(str(k) for k in obj if k not in keys)
    if unknown:
        raise SettingError(f"{prefix}unknown key(s) {', '.join(unknown)}; known: "
                           f"{', '.join(keys)}")
    out = {}
    for key, value in obj.items():
        try:
            out[keys[key].name] = keys[key].coerce(value)
        except ValueError as exc:
            raise SettingError(f"{prefix}{key}: {exc}") from None
    return out


def json_text(value: Any) -> Any:
    """A JSON config given as text (the flag's spelling) or as the mapping itself."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise SettingError(f"not valid JSON ({exc})") from None
