"""The README's headline table, generated from the results files in benchmarks/results/.

    python -m benchmarks.headline            # rewrite the table in README.md
    python -m benchmarks.headline --check    # exit 1 if README.md differs from the results files

One row per results file that benchmarks/headline_rows.py has a row for, in that order: what is
compared with what, the figures, and the machine, date, commit and command from the file.
Files without provenance (written before benchmarks/results_file.py) get no row."""

from __future__ import annotations

import argparse
import difflib
import string
import sys
from pathlib import Path

from benchmarks.headline_rows import NOT_HEADLINED, ROWS, Row
from benchmarks.results_file import REPO, RESULTS, ResultsFileError, read

README = REPO / "README.md"
START, END = "<!-- headline:start -->", "<!-- headline:end -->"
HEAD = ("| compared | figures | machine | date, commit | command |\n"
        "|---|---|---|---|---|")
# The flags that say which kernels a CPU figure ran on, most telling first.
FLAG_LABELS = (("amx_tile", "AMX"), ("avx512f", "AVX512"), ("avx512_vnni", "VNNI"), ("avx_vnni", "AVX-VNNI"),
               ("avx512_bf16", "BF16"), ("avx2", "AVX2"), ("neon", "NEON"), ("asimd", "NEON"))


class _Figures(string.Formatter):
    def format_field(self, value, format_spec: str) -> str:
        return "n/a" if value is None else super().format_field(value, format_spec)


def figure(template: str, doc: dict) -> str | None:
    """`template` filled from the file's summary, args and results; None if a field is absent."""
    fields = {**doc["summary"], "args": doc["results"].get("args") or {}, "results": doc["results"]}
    try:
        return _Figures().vformat(template, (), fields)
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def machine(m: dict) -> str:
    labels = list(dict.fromkeys(label for flag, label in FLAG_LABELS if flag in m.get("cpu_flags", [])))
    if "AVX512" in labels and "AVX2" in labels:
        labels.remove("AVX2")
    text = f"{m.get('cpu_model')}, {m.get('cores')} cores" + (f", {' '.join(labels)}" if labels else "")
    return text + "".join(f"; {gpu}" for gpu in m.get("gpus") or [])


def provenance(doc: dict) -> str:
    commit = doc["commit"] or "no commit"
    short = commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")
    return f"{doc['date'][:10]}, `{short}`"


def load(results_dir: Path) -> tuple[dict[str, dict], list[str]]:
    """The results files by stem, and a note for each file left out."""
    docs, notes = {}, []
    for path in sorted(results_dir.glob("*.json")):
        try:
            docs[path.stem] = read(path)
        except ResultsFileError as exc:
            notes.append(f"left out: {exc}")
    return docs, notes


def like_for_like(row: Row, doc: dict, docs: dict[str, dict]) -> str:
    other = docs.get(row.like_for_like)
    spec = next(r for r in ROWS if r.stem == row.like_for_like)
    if other is None:
        return f"like for like: no `{row.like_for_like}` results yet"
    shown = [f for f in (figure(t, other) for t in spec.figures[:2]) if f]
    where = "" if other["machine"] == doc["machine"] else f", {machine(other['machine'])}"
    return f"like for like (`{row.like_for_like}`, {provenance(other)}{where}): " + ", ".join(shown)


def rows(docs: dict[str, dict]) -> tuple[list[str], list[str]]:
    lines, notes = [], []
    for row in ROWS:
        doc = docs.get(row.stem)
        if doc is None:
            continue
        if doc["benchmark"] != row.benchmark:
            notes.append(f"left out: {row.stem}.json was written by {doc['benchmark']}, not {row.benchmark}")
            continue
        shown = [figure(t, doc) for t in row.figures]
        compared = row.compared(doc) if callable(row.compared) else figure(row.compared, doc)
        if shown[0] is None or compared is None:
            notes.append(f"left out: {row.stem}.json lacks the fields of its row (a run without its baseline?)")
            continue
        figures = "; ".join(f for f in shown if f)
        if row.like_for_like:
            figures += "; " + like_for_like(row, doc, docs)
        cells = (compared, figures, machine(doc["machine"]), provenance(doc), f"`{doc['command']}`")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines, notes


def table(results_dir: Path = RESULTS) -> tuple[str, list[str]]:
    docs, notes = load(results_dir)
    body, more = rows(docs)
    known = {r.stem for r in ROWS}
    notes += more + [f"no row for {stem}.json" for stem, doc in docs.items()
                     if stem not in known and doc["benchmark"] not in NOT_HEADLINED]
    return "\n".join([HEAD, *body]) if body else "No benchmark has written a results file yet.", notes


def results_index(results_dir: Path = RESULTS) -> str:
    """The docs site's page of results files: each with its command, machine and date, linked."""
    lines = ["# Results files", "",
             "Every benchmark writes `benchmarks/results/<name>.json`: its summary (the JSON line it "
             "ends with), the detail behind it, and the machine, commit, date and command of the run. "
             "A file holds the latest run that wrote it; the README's headline table is generated "
             "from these files.", ""]
    for path in sorted(results_dir.glob("*.json")):
        try:
            doc = read(path)
        except ResultsFileError:
            lines.append(f"- [`{path.name}`](results/{path.name}): written before results files "
                         "recorded their machine, commit and date")
            continue
        lines.append(f"- [`{path.name}`](results/{path.name}): `{doc['command']}`; "
                     f"{machine(doc['machine'])}; {provenance(doc)}")
    return "\n".join(lines) + "\n"


def render(readme: str, generated: str) -> str:
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise SystemExit(f"README.md needs one {START} … {END} pair around the headline table")
    before, rest = readme.split(START)
    _, after = rest.split(END)
    return f"{before}{START}\n{generated}\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md differs; write nothing")
    p.add_argument("--results", default=str(RESULTS), help="the folder of results files")
    p.add_argument("--readme", default=str(README))
    args = p.parse_args(argv)
    readme = Path(args.readme)
    generated, notes = table(Path(args.results))
    for note in notes:
        print(note, file=sys.stderr)
    current = readme.read_text()
    wanted = render(current, generated)
    if args.check:
        if wanted == current:
            return 0
        sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), wanted.splitlines(True),
                                                   str(readme), "generated from benchmarks/results"))
        print(f"{readme.name}'s headline table differs from the results files: run python -m benchmarks.headline",
              file=sys.stderr)
        return 1
    if wanted != current:
        readme.write_text(wanted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
