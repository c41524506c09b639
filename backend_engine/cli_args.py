"""Config dataclasses as command-line flags, in vLLM's `EngineArgs` pattern: each field of
`EngineConfig` and `ServerSettings` declares its flag beside its default (cli_fields.py); the
functions here add those flags to a parser (`add_cli_args`), read a parsed command line back
into the dataclass's keyword arguments (`from_cli_args`), read a mapping of settings the same
way (`from_mapping`: a config file's section, LLM()'s keywords), and write field values out as
the argv that parser reads (`to_argv`: how `kvgate up` starts its replicas). A default lives in
the dataclass alone. Argparse and json only: `kvgate --help` never loads torch."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from backend_engine.cli_fields import (JsonConfig, Setting, SettingError, expand_json,
                                       json_configs, json_fields, json_text, settings)


def _json_type(cls: type, config: JsonConfig) -> Callable[[str], dict]:
    def parse(text: str) -> dict:
        obj = json_text(text)
        expand_json(cls, config, obj)  # argparse names the flag in the error
        return obj

    return parse


def key_value(text: str) -> tuple[str, str]:
    """`--engine-option KEY=VALUE`'s argparse type."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def add_cli_args(parser: argparse.ArgumentParser, cls: type, only: Iterable[str] | None = None,
                 action: type[argparse.Action] | None = None) -> None:
    """Add a flag for every field of `cls` (or the fields and JSON configs named in `only`, in
    the parser's main options, stored with `action`), in the fields' argument groups."""
    wanted = list(only) if only is not None else None
    containers: dict[str | None, Any] = {None: parser}
    exclusive: dict[str, Any] = {}

    def container(group: str | None, together: str | None) -> Any:
        group = None if wanted is not None else group
        if group not in containers:
            containers[group] = parser.add_argument_group(group)
        if together is None or wanted is not None:
            return containers[group]
        if together not in exclusive:
            exclusive[together] = containers[group].add_mutually_exclusive_group()
        return exclusive[together]

    added: set[str] = set()
    for s in settings(cls):
        config = s.meta.json
        if config is not None and config.name not in added \
                and (wanted is None or config.name in wanted):
            added.add(config.name)
            keys = ", ".join(json_fields(cls, config))
            container(config.group, None).add_argument(
                config.flag, dest=config.name, default=None, metavar="JSON",
                type=_json_type(cls, config), action=action,
                help=f"{config.help} (keys: {keys})")
        if not s.meta.has_flag or (wanted is not None and s.name not in wanted):
            continue
        _add_flag(container(s.meta.group, s.meta.exclusive), s, action)


def _help(s: Setting) -> str:
    if s.default in (None, [], {}) or "default" in s.meta.help:
        return s.meta.help
    shown = ("on" if s.default else "off") if s.kind is bool else "%(default)s"
    return f"{s.meta.help} (default: {shown})"


def _add_flag(group: Any, s: Setting, action: type[argparse.Action] | None) -> None:
    names = [s.flag, *s.meta.aliases]
    common = {"dest": s.name, "help": _help(s)}
    if s.kind is bool:
        group.add_argument(*names, action=argparse.BooleanOptionalAction, default=s.default,
                           **common)
        if s.meta.off_alias:
            group.add_argument(s.meta.off_alias, dest=s.name, action="store_false",
                               help=argparse.SUPPRESS)
    elif s.kind is dict:
        group.add_argument(*names, action="append", type=key_value, default=None,
                           metavar=s.meta.metavar or "KEY=VALUE", **common)
    else:
        group.add_argument(*names, type=s.parse_text, default=s.default, action=action,
                           choices=s.meta.choices, nargs=s.meta.nargs,
                           metavar=s.meta.metavar or _metavar(s), **common)


def _metavar(s: Setting) -> str | None:
    """As argparse names it, but from the flag (--kv-cache-memory GIB, not the field's name)."""
    if s.meta.choices is not None:
        return None  # argparse shows the choices
    return s.flag.removeprefix("--").replace("-", "_").upper()


def from_cli_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for `cls` from a command line parsed by `add_cli_args`' flags."""
    out: dict[str, Any] = {}
    for s in settings(cls):
        if s.meta.has_flag:
            value = getattr(args, s.name)
            out[s.name] = dict(value or ()) if s.kind is dict else value
    for config in json_configs(cls):
        if getattr(args, config.name, None) is not None:
            out.update(expand_json(cls, config, getattr(args, config.name)))
    return out


def from_mapping(classes: Iterable[type], values: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per class, keyword arguments from `values` keyed by field names or JSON-config names
    (a config file's section, LLM()'s keywords); text is parsed as the flags parse it."""
    classes = list(classes)
    out: list[dict[str, Any]] = [{} for _ in classes]
    for name, value in values.items():
        for i, cls in enumerate(classes):
            fields = {s.name: s for s in settings(cls)}
            configs = {c.name: c for c in json_configs(cls)}
            if name in configs:
                try:
                    obj = json_text(value)
                except SettingError as exc:
                    raise SettingError(f"{name}: {exc}") from None
                found = expand_json(cls, configs[name], obj, name)
            elif name in fields:
                try:
                    found = {name: fields[name].coerce(value)}
                except ValueError as exc:
                    raise SettingError(f"{name}: {exc}") from None
            else:
                continue
            twice = sorted(set(found) & set(out[i]))
            if twice:
                raise SettingError(f"{', '.join(twice)} given twice (on its own and in {name})")
            out[i].update(found)
            break
        else:
            known = sorted(n for cls in classes for n in [*(s.name for s in settings(cls)),
                                                          *(c.name for c in json_configs(cls))])
            raise SettingError(f"unknown setting {name!r}; known: {', '.join(known)}")
    return out


def to_argv(classes: Iterable[type], values: Mapping[str, Any]) -> list[str]:
    """The flags that make `add_cli_args`' parser yield these field values (see from_mapping)."""
    fields = {s.name: s for cls in classes for s in settings(cls)}
    argv: list[str] = []
    objects: dict[JsonConfig, dict[str, Any]] = {}
    for name, value in values.items():
        s = fields[name]
        if s.meta.json is not None:
            objects.setdefault(s.meta.json, {})[s.meta.key or s.name] = value
        elif s.meta.via is not None:
            how = f"; the command line sets it by {s.meta.via}" if s.meta.via else ""
            raise SettingError(f"{name} has no flag of its own{how}")
        elif s.kind is bool:
            argv.append(s.flag if value else "--no-" + s.flag[2:])
        elif s.kind is dict:
            argv += [item for k, v in value.items() for item in (s.flag, f"{k}={v}")]
        elif s.kind is list:
            argv += [s.flag, *map(str, value)]
        elif value is None:
            if s.optional and s.kind in (int, float):
                argv += [s.flag, "none"]
            elif s.default is not None:
                raise SettingError(f"{name}: null has no flag; give a value")
        else:
            text = str(value)
            argv += [f"{s.flag}={text}"] if text.startswith("-") else [s.flag, text]
    for config, obj in objects.items():
        argv += [config.flag, json.dumps(obj)]
    return argv
