"""MkDocs hook: the flag and config-key reference, generated from the code at every build.

The pages under `reference/cli/` come from the argparse parsers of `kvgate engine`,
`kvgate gateway` and `kvgate up` (`kvgate.cli.build_parser()`), and those under
`reference/config/` from the config dataclasses: the flag each field declares beside its default
(backend_engine/cli_fields.py) or, without one, the comments beside it. Nothing here lists a
flag or a key, so a flag added to a parser is in the next build's reference.
The benchmark plots in `benchmarks/results/` are served as `benchmarks/plots/`, the results
files as `benchmarks/results/`, listed on a generated page, `benchmarks/results-files.md`, and
`benchmarks/results/history/measurements.md` (figures recorded before results files existed) as
`benchmarks/history.md`.

    python docs/hooks/reference.py OUT_DIR      # write the same pages to a folder, to read them
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import io
import re
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # document this checkout's code, not an installed copy's
    sys.path.insert(0, str(ROOT))

_WIDTH = 80  # usage lines are wrapped the same on every machine


@dataclass(frozen=True)
class ConfigSource:
    module: str
    cls: str
    page: str = ""  # "" for a dataclass that only lends flags their meanings
    title: str = ""
    intro: str = ""


@dataclass(frozen=True)
class CommandPage:
    command: str
    page: str
    sources: tuple[ConfigSource, ...]  # meanings and defaults for flags whose help gives none


ENGINE_CONFIG = ConfigSource(
    "backend_engine.config", "EngineConfig", "reference/config/engine.md", "EngineConfig",
    "The engine's configuration: the keyword arguments of `LLM(...)` and `EngineConfig(...)`. "
    "Each field declares its flag, default and help in one place, and `kvgate engine`'s flags "
    "are built from them, so `LLM()` and `kvgate engine` start the same engine; `kvgate up`'s "
    "`engine:` section takes the same keys. Fields in a JSON flag are set by its key; "
    "`LLM()` also takes those flags' mappings (`speculative_config={...}`).")
SERVER_SETTINGS = ConfigSource("backend_engine.server.settings", "ServerSettings")
GATEWAY_CONFIG = ConfigSource(
    "gateway.config", "GatewayConfig", "reference/config/gateway.md", "Gateway config file",
    "The keys of `kvgate gateway --config FILE` (YAML or JSON). Later sources win: the file, "
    "then the environment, then flags. The entries of `api_keys` are described in "
    "[Keys, limits and tenants](../../gateway/keys-and-tenants.md).")
UP_CONFIG = ConfigSource(
    "kvgate.launcher.config", "UpConfig", "reference/config/up.md", "`kvgate up` config file",
    "The keys of `kvgate up --config FILE` (YAML). Flags typed on the command line win over the "
    "file, which wins over the defaults; an unknown key is an error that names it. See "
    "[kvgate up](../../running/kvgate-up.md).")
COMMANDS = (
    CommandPage("engine", "reference/cli/engine.md", (ENGINE_CONFIG, SERVER_SETTINGS)),
    CommandPage("gateway", "reference/cli/gateway.md", (GATEWAY_CONFIG,)),
    CommandPage("up", "reference/cli/up.md", (UP_CONFIG,)),
)
PLOTS = ROOT / "benchmarks" / "results"
HISTORY = PLOTS / "history" / "measurements.md"  # figures recorded before results files


# --- config dataclasses ---------------------------------------------------------------------

@dataclass(frozen=True)
class Key:
    name: str
    type: str
    default: object
    meaning: str
    flag: str | None = None  # Markdown for the flag column; None: found in the parser


def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment beside it (trailing) or the comment lines just above it."""
    lines, _ = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            above, n = [], node.lineno - 1
            while n in comments and source.splitlines()[n - 1].lstrip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            out[node.target.id] = " ".join(above + trailing)
    return out


def _declared_flag(s) -> str:  # noqa: ANN001 - cli_fields.Setting
    """The flag column for a field that declares its flag."""
    if s.meta.json is not None:
        return f"`{s.meta.json.flag}` key `{s.meta.key or s.name}`"
    if s.meta.via is not None:
        return _cell(s.meta.via) if s.meta.via else "Python only"
    return f"`{s.flag}`"


def _source_class(source: ConfigSource) -> type:
    return getattr(importlib.import_module(source.module), source.cls)


def config_keys(source: ConfigSource) -> list[Key]:
    from backend_engine.cli_fields import settings

    cls = _source_class(source)
    comments = _field_comments(cls)
    declared = {s.name: s for s in settings(cls)}
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        s = declared.get(f.name)
        keys.append(Key(f.name, str(f.type), default,
                        s.meta.help if s else comments.get(f.name, ""),
                        _declared_flag(s) if s else None))
    return keys


# --- argparse -------------------------------------------------------------------------------

def subcommands() -> argparse._SubParsersAction:
    from kvgate.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise RuntimeError("kvgate.cli.build_parser() has no subcommands")


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return parser.formatter_class(prog=parser.prog, width=_WIDTH)


def usage(parser: argparse.ArgumentParser) -> str:
    formatter = _formatter(parser)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def flag_spelling(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = _formatter(parser)
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    metavar = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    return ", ".join(f"{opt} {metavar}" for opt in action.option_strings)


# --- Markdown -------------------------------------------------------------------------------

def _cell(text: str) -> str:
    """Text for one table cell, with Markdown's specials escaped outside `code` spans."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # outside code spans; inside them `|` splits no cell
        for ch in "\\*_[]|":
            parts[i] = parts[i].replace(ch, "\\" + ch)
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return " ".join("`".join(parts).split())


def _sentence(text: str) -> str:
    text = text.strip()
    return text + "." if text and text[-1] not in ".!?" else text


def _value(value: object) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value is None or value is dataclasses.MISSING or value == [] or value == {}:
        return "–"
    return f"`{value}`" if value != "" else '`""`'


def help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help as `--help` prints it (`%(default)s` and friends expanded)."""
    return _formatter(parser)._expand_help(action) if action.help else ""


def _without_default(help_: str, action: argparse.Action) -> str:
    """The help less a closing "(default: VALUE)" naming the default: the page has a column."""
    match = re.search(r"\s*\(default: ([^()]*)\)$", help_)
    if match and match.group(1) in (str(action.default), "on" if action.default else "off"):
        return help_[:match.start()]
    return help_


def _flag_meaning(help_: str, action: argparse.Action, group_note: str, fallback: str) -> str:
    parts = [_sentence(help_ or fallback)]
    if action.choices:
        parts.append("One of: " + ", ".join(f"`{c}`" for c in action.choices) + ".")
    if isinstance(action, argparse._AppendAction) and "repeat" not in help_.lower():
        parts.append("Repeat the flag for more.")
    if group_note:
        parts.append(group_note)
    return " ".join(_cell(p) if i == 0 else p for i, p in enumerate(parts) if p)


def _config_names(dest: str) -> tuple[str, ...]:
    """The config keys a flag's dest may set: the same name, a plural, or `no_x` for `enable_x`."""
    names = (dest, dest + "s")
    return names + ("enable_" + dest[3:],) if dest.startswith("no_") else names


def command_page(spec: CommandPage, parser: argparse.ArgumentParser, summary: str) -> str:
    keys = {k.name: k for source in spec.sources for k in config_keys(source)}
    exclusive = {}
    for group in parser._mutually_exclusive_groups:
        names = [a.option_strings[0] for a in group._group_actions]
        for a in group._group_actions:
            exclusive[a.dest] = "Give at most one of " + ", ".join(f"`{n}`" for n in names) + "."
    out = [f"# `kvgate {spec.command}`\n",
           f"{summary[:1].upper() + summary[1:]}.\n" if summary else "",
           "Generated at build time from the command's argparse parser "
           "(`kvgate.cli.build_parser()`); `kvgate " + spec.command + " --help` prints the same.\n",
           "```text\n" + usage(parser) + "\n```\n"]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.option_strings and not isinstance(a, argparse._HelpAction)
                   and a.help != argparse.SUPPRESS]
        if not actions:
            continue
        title = "Options" if group.title in ("options", "optional arguments") else group.title
        out.append(f"## {title[:1].upper() + title[1:]}\n")
        out.append("| flag | default | meaning |\n|---|---|---|")
        for a in actions:
            key = next((keys[n] for n in _config_names(a.dest) if n in keys), None)
            default = a.default
            if default is None and key is not None and key.name == a.dest:
                default = key.default
            meaning = _flag_meaning(_without_default(help_text(parser, a), a), a,
                                    exclusive.get(a.dest, ""), key.meaning if key else "")
            shown = ("on" if default else "off") if a.nargs == 0 else _value(default)
            out.append(f"| `{flag_spelling(parser, a)}` | {shown} | {meaning} |")
        out.append("")
    return "\n".join(out + _json_key_tables(spec, parser))


def _json_key_tables(spec: CommandPage, parser: argparse.ArgumentParser) -> list[str]:
    """Per JSON flag of the command (--speculative-config …): its keys and the fields they set."""
    from backend_engine.cli_fields import json_configs, json_fields

    dests = {a.dest for a in parser._actions}
    out = []
    for source in spec.sources:
        cls = _source_class(source)
        for config in json_configs(cls):
            if config.name not in dests:
                continue
            out += [f"## `{config.flag}` keys\n",
                    f"The JSON object's keys; each sets a field of `{source.cls}` (and "
                    f"`LLM({config.name}={{...}})` takes the same mapping). An unknown key is "
                    "refused, naming the flag.\n",
                    "| key | field | default | meaning |\n|---|---|---|---|"]
            for key, s in json_fields(cls, config).items():
                values = dict(s.meta.value_aliases)
                also = (" Also: " + ", ".join(f"`{k}` (= `{v}`)" for k, v in values.items()) + "."
                        if values else "")
                out.append(f"| `{key}` | `{s.name}` | {_value(s.default)} | "
                           f"{_cell(_sentence(s.meta.help))}{also} |")
            out.append("")
    return out


def config_page(source: ConfigSource, parser: argparse.ArgumentParser) -> str:
    flags: dict[str, argparse.Action] = {}
    for a in parser._actions:
        if a.option_strings and not isinstance(a, argparse._HelpAction):
            flags.update({name: a for name in _config_names(a.dest)})
    module_path = source.module.replace(".", "/") + ".py"
    out = [f"# {source.title}\n", source.intro + "\n",
           f"Generated at build time from `{source.cls}` in `{module_path}` "
           "and the comments beside its fields.\n",
           "| key | type | default | flag | meaning |\n|---|---|---|---|---|"]
    for k in config_keys(source):
        action = flags.get(k.name)
        flag = k.flag if k.flag is not None else f"`{action.option_strings[0]}`" if action else ""
        meaning = _sentence(k.meaning or (help_text(parser, action) if action else ""))
        out.append(f"| `{k.name}` | `{k.type}` | {_value(k.default)} | {flag} | {_cell(meaning)} |")
    return "\n".join(out) + "\n"


def pages() -> dict[str, str]:
    """Every generated page: docs path -> Markdown."""
    sub = subcommands()
    summaries = {choice.dest: choice.help or "" for choice in sub._choices_actions}
    out = {}
    for spec in COMMANDS:
        parser = sub.choices[spec.command]
        out[spec.page] = command_page(spec, parser, summaries.get(spec.command, ""))
        for source in spec.sources:
            if source.page:
                out[source.page] = config_page(source, parser)
    return out


# --- the MkDocs hook ------------------------------------------------------------------------

def on_files(files, config):  # noqa: ANN001, ANN201 - MkDocs' hook signature
    from mkdocs.structure.files import File

    for path, markdown in pages().items():
        files.append(File.generated(config, path, content=markdown))
    for png in sorted(PLOTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/plots/{png.name}", abs_src_path=str(png)))
    from benchmarks.headline import results_index

    files.append(File.generated(config, "benchmarks/results-files.md", content=results_index(PLOTS)))
    for result in sorted(PLOTS.glob("*.json")):
        files.append(File.generated(config, f"benchmarks/results/{result.name}", abs_src_path=str(result)))
    files.append(File.generated(config, "benchmarks/history.md", abs_src_path=str(HISTORY)))
    return files


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for path, markdown in pages().items():
        target = Path(sys.argv[1]) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(markdown)
        print(target)
