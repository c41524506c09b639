"""The documentation site builds strictly, and its generated reference names every flag of
`kvgate engine`, `kvgate gateway` and `kvgate up`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvgate.cli import build_parser
from tests.docs.docs_paths import MKDOCS_YML, build_site

COMMANDS = ("engine", "gateway", "up")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    result = build_site(MKDOCS_YML, site_dir)
    assert result.returncode == 0, result.stdout
    assert "WARNING" not in result.stdout, result.stdout
    return site_dir


def help_flags(command: str, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Every flag `kvgate COMMAND --help` prints (read from the help text, not the parser's
    internals the generator uses), on a terminal wide enough that no line wraps at a hyphen."""
    monkeypatch.setenv("COLUMNS", "10000")
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return set(FLAG.findall(sub.format_help())) - {"--help"}


def test_site_builds_strictly_with_every_section(site: Path):
    for page in ("index.html", "getting-started/index.html", "concepts/block-hash/index.html",
                 "engine/index.html", "api/openai/index.html", "gateway/pins/index.html",
                 "running/kvgate-up/index.html", "benchmarks/serve-bench/index.html",
                 "reliability/index.html", "reference/metrics/index.html"):
        assert (site / page).is_file(), page
    for plot in ("routing_sim_hit_rate.png", "serve_bench_ttft_cdf.png"):
        assert (site / "benchmarks" / "plots" / plot).stat().st_size > 0


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_in_the_generated_reference(site: Path, command: str,
                                                  monkeypatch: pytest.MonkeyPatch):
    flags = help_flags(command, monkeypatch)
    assert len(flags) >= 10
    page = (site / "reference" / "cli" / command / "index.html").read_text()
    # a cell may spell several (--enable-prefix-caching, --no-enable-prefix-caching)
    cells = {flag for cell in re.findall(r"<td><code>(--[^<]+)</code>", page)
             for flag in FLAG.findall(cell)}
    assert flags <= cells, f"kvgate {command}: flags missing from the reference: {sorted(flags - cells)}"


@pytest.mark.parametrize("name", ("engine", "gateway", "up"))
def test_config_reference_lists_every_field(site: Path, name: str):
    import dataclasses

    from backend_engine.config import EngineConfig
    from gateway.config import GatewayConfig
    from kvgate.launcher.config import UpConfig

    cls = {"engine": EngineConfig, "gateway": GatewayConfig, "up": UpConfig}[name]
    page = (site / "reference" / "config" / name / "index.html").read_text()
    keys = set(re.findall(r"<td><code>([a-z0-9_]+)</code></td>", page))
    assert {f.name for f in dataclasses.fields(cls)} <= keys


def test_strict_build_fails_on_a_broken_link_and_a_page_left_out_of_the_nav(tmp_path: Path):
    """The validation settings of mkdocs.yml turn these into errors, not notes in a log."""
    config = yaml.safe_load(MKDOCS_YML.read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the missing page](missing.md).\n")
    (docs / "orphan.md").write_text("# Not in the nav\n")
    config.update(docs_dir=str(docs), nav=[{"Home": "index.md"}], hooks=[])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    result = build_site(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "missing.md" in result.stdout and "orphan.md" in result.stdout
