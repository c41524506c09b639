"""Kernel tests run under triton's CPU interpreter unless a run asks for the GPU
(TRITON_INTERPRET=0, as benchmarks/gpu_check.sh does). The variable must be set before triton
is imported, which is why it is set here, at collection time."""

import importlib.util
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("triton") is None:  # the `gpu` extra is not installed
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def device() -> str:
    import torch

    if os.environ["TRITON_INTERPRET"] == "1" or not torch.cuda.is_available():
        return "cpu"
    return "cuda"
