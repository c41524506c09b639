"""The README's headline table is what `python -m benchmarks.headline` generates from the results
files: a figure changed in either place alone fails here. No benchmark runs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import headline, results_file
from benchmarks.headline_rows import NOT_HEADLINED, ROWS
from tests.docs.docs_paths import ROOT

README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture
def copy(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the README and of the results files, to change without touching the checkout."""
    results = tmp_path / "results"
    results.mkdir()
    for path in RESULTS.glob("*.json"):
        shutil.copy(path, results)
    shutil.copy(README, tmp_path / "README.md")
    return tmp_path / "README.md", results


def check(readme: Path, results: Path) -> int:
    return headline.main(["--check", "--readme", str(readme), "--results", str(results)])


def write_doc(results: Path, stem: str, benchmark: str, summary: dict, args: dict) -> None:
    results_file.write(benchmark, summary, {"args": args}, argv=[], path=results / f"{stem}.json")


def test_readme_headline_matches_the_results_files():
    assert headline.main(["--check"]) == 0, "run: python -m benchmarks.headline"


def test_the_table_is_between_the_markers_and_names_every_results_file_with_a_row():
    text = README.read_text()
    table = text.split(headline.START)[1].split(headline.END)[0]
    docs, _ = headline.load(RESULTS)
    for row in ROWS:
        if row.stem in docs and row.benchmark == docs[row.stem]["benchmark"]:
            assert f"`{docs[row.stem]['command']}`" in table


def test_check_fails_when_a_figure_changes_and_passes_once_regenerated(copy):
    readme, results = copy
    write_doc(results, "eviction", "eviction", {"valuable_prefix_hit_lru": 0.0, "valuable_prefix_hit_slru_pin": 0.5,
                                                "overall_hit_ratio_vs_lru": 1.2},
              {"requests": 1200, "kv_blocks": 256, "model": "tiny-random"})
    assert check(readme, results) == 1
    assert headline.main(["--readme", str(readme), "--results", str(results)]) == 0
    assert check(readme, results) == 0
    assert "pinned prefix hit rate 0.5 vs 0.0" in readme.read_text()


def test_check_fails_when_the_readme_is_edited_by_hand(copy):
    readme, results = copy
    text = readme.read_text()
    table = text.split(headline.START)[1]
    readme.write_text(text.replace(table, table.replace("|---|", "|---|\n| hand-written | ×99 | | | |", 1), 1))
    assert check(readme, results) == 1


def test_a_file_without_provenance_gets_no_row(copy):
    readme, results = copy
    (results / "gateway_overhead.json").write_text(json.dumps({"added_p50_ms": 1.0, "added_p99_ms": 2.0}))
    generated, notes = headline.table(results)
    assert "benchmarks.gateway_overhead" not in generated
    assert any("gateway_overhead.json" in note for note in notes)


def test_a_ratio_over_different_weights_says_so_and_shows_the_like_for_like_one(tmp_path: Path):
    args = {"requests": 32, "prompt_tokens": 128, "new_tokens": 128, "concurrency": 16, "dtype": "float32"}
    write_doc(tmp_path, "engine_throughput_int8", "engine_throughput",
              {"speedup_vs_hf": 18.0, "speedup_vs_hf_cb": 3.5, "kvgate_tok_s": 155.7},
              {**args, "quantization": "int8"})
    alone, _ = headline.table(tmp_path)
    assert "kvgate engine (int8 weights, fp32 compute, 16 at once)" in alone
    assert "transformers (fp32 weights) `generate` one request at a time" in alone
    assert "the weights differ (int8 vs fp32)" in alone
    assert "like for like: no `engine_throughput` results yet" in alone
    write_doc(tmp_path, "engine_throughput", "engine_throughput",
              {"speedup_vs_hf": 6.1, "speedup_vs_hf_cb": 1.6, "kvgate_tok_s": 117.7}, {**args, "quantization": None})
    both, _ = headline.table(tmp_path)
    assert "like for like (`engine_throughput`" in both and "×6.1 `generate`, ×1.6 `generate_batch`" in both


def test_a_run_without_its_baseline_gets_no_row(tmp_path: Path):
    write_doc(tmp_path, "trace_load", "trace_load", {"requests": 150, "kvgate_finished": 150},
              {"rows": 150, "speedup": 3.0, "servers": "kvgate", "llamacpp_parallel": 16})
    generated, notes = headline.table(tmp_path)
    assert "benchmarks.trace_load" not in generated
    assert any("lacks the fields of its row" in note for note in notes)


def test_every_benchmark_that_writes_results_has_a_row_or_a_reason_not_to():
    written = {m for path in (ROOT / "benchmarks").glob("*.py")
               for m in re.findall(r'results_file\.write\(\s*"(\w+)"', path.read_text())}
    assert len(written) >= 20
    missing = written - {row.benchmark for row in ROWS} - set(NOT_HEADLINED)
    assert not missing, f"benchmarks with no headline row and no reason: {sorted(missing)}"
