"""benchmarks/results_file.py: every results file says what ran, where, from which commit, when
and how; credentials given on the command line stay out of it."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from benchmarks import results_file
from benchmarks.results_file import FIELDS, ResultsFileError

XEON = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\n"
        "flags\t\t: fpu sse sse2 avx avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 "
        "amx_bf16 amx_tile amx_int8 aes\n")


def test_a_results_file_records_machine_commit_date_command_results_and_summary(tmp_path: Path):
    args = argparse.Namespace(requests=8, api_key="sk-secret")
    path = results_file.write("routing_sim", {"hit": 0.9}, {"args": vars(args)},
                              argv=["--requests", "8"], path=tmp_path / "x.json")
    doc = json.loads(path.read_text())
    assert list(doc) == list(FIELDS)
    assert doc["benchmark"] == "routing_sim" and doc["summary"] == {"hit": 0.9}
    assert doc["command"] == "python -m benchmarks.routing_sim --requests 8"
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", doc["commit"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", doc["date"])
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["cpu_model"]
    assert {"cpu_flags", "memory_gib", "os", "torch", "python", "gpus"} <= set(doc["machine"])
    assert doc["results"]["args"] == {"requests": 8, "api_key": "REDACTED"}
    assert results_file.read(path) == doc


def test_only_the_flags_that_pick_kernels_are_kept():
    flags = results_file.key_cpu_flags(XEON, "x86_64")
    assert flags == sorted(["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                            "amx_bf16", "amx_tile", "amx_int8"])
    assert results_file.cpu_model(XEON).startswith("Intel(R) Xeon(R) Platinum 8481C")
    assert results_file.key_cpu_flags("", "arm64") == ["neon"]


def test_credentials_in_the_command_are_redacted():
    shown = results_file.command("serve_bench", ["--api-key", "sk-1", "--admin-key=s3cr3t",
                                                 "--prompt-tokens", "64", "--key-file", "k.pem"])
    assert "sk-1" not in shown and "s3cr3t" not in shown
    assert shown == ("python -m benchmarks.serve_bench --api-key REDACTED --admin-key=REDACTED "
                     "--prompt-tokens 64 --key-file k.pem")


@pytest.mark.parametrize("text", ['{"headline": {"x": 1}, "runs": []}', "not json", "[1, 2]"])
def test_a_file_without_provenance_is_refused(tmp_path: Path, text: str):
    path = tmp_path / "old.json"
    path.write_text(text)
    with pytest.raises(ResultsFileError, match="old.json"):
        results_file.read(path)
