"""README.md stays a five-minute page: short, the two quick-start commands, links that resolve."""

from __future__ import annotations

import re

from tests.docs.docs_paths import ROOT

README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_under_two_hundred_lines():
    assert len(README.read_text().splitlines()) <= 200


def test_quick_start_is_make_serve_and_make_test():
    text = README.read_text()
    block = re.search(r"## Quick start\n+```bash\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make serve", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^serve:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_every_relative_link_resolves():
    links = LINK.findall(README.read_text())
    relative = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert relative, "the README links into the docs"
    missing = [link for link in relative if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
