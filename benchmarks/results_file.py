"""The results file every benchmark writes, `benchmarks/results/<name>.json`: what it measured,
and on what, from which commit, when and with which command.

    {"benchmark", "machine": {"cpu_model", "arch", "cpu_flags", "cores", "memory_gib", "gpus",
     "os", "torch", "python"}, "commit", "date", "command", "results": {...}, "summary": {...}}

`summary` is the benchmark's final JSON line, `results` what stands behind it (its arguments,
per-run figures). The README's headline table is generated from these files
(`python -m benchmarks.headline`), so a figure there always names its machine and command."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]
FIELDS = ("benchmark", "machine", "commit", "date", "command", "results", "summary")
# The flags that decide which kernels run (SIMD width, int8 dot products, bf16, AMX tiles).
KEY_FLAGS = re.compile(r"avx2|fma|f16c|avx512\w*|avx_vnni\w*|amx\w*|\w*bf16\w*|neon|asimd\w*|sve\w*")
# Credentials given to a benchmark (--api-key, --admin-key) stay out of its results file.
SECRET = re.compile(r"(\w*[_-])?(key|secret|password)s?")
REDACTED = "REDACTED"


class ResultsFileError(ValueError):
    """A results file that is not in the shape above (an older file without provenance)."""


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware") and value.strip():
            return value.strip()
    if platform.system() == "Darwin":
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return platform.processor() or platform.machine()


def key_cpu_flags(cpuinfo: str, arch: str) -> list[str]:
    # Imported here: backend_engine's import sets OpenMP variables, which benchmarks of the
    # gateway and the router should not pass on to the processes they start.
    from backend_engine.dtype import cpu_flags

    flags = sorted({f for f in cpu_flags(cpuinfo) if KEY_FLAGS.fullmatch(f)})
    if not flags and arch in ("arm64", "aarch64"):
        return ["neon"]  # every AArch64 CPU has it; macOS has no /proc/cpuinfo to say so
    return flags


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def gpus() -> list[str]:
    """NVIDIA GPUs by name, from nvidia-smi (the benchmark need not have loaded torch)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def machine() -> dict:
    cpuinfo, arch = _cpuinfo(), platform.machine()
    return {"cpu_model": cpu_model(cpuinfo), "arch": arch, "cpu_flags": key_cpu_flags(cpuinfo, arch),
            "cores": os.cpu_count(), "memory_gib": _memory_gib(), "gpus": gpus(),
            "os": f"{platform.system()} {platform.release()}", "torch": _version("torch"),
            "python": platform.python_version()}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> str | None:
    """HEAD, with "-dirty" when code differs from it (results files written by earlier runs do
    not count); None outside a git checkout."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return None
    changes = _git("status", "--porcelain", "--", ".", f":(exclude){RESULTS.relative_to(REPO)}")
    return head + "-dirty" if changes else head


def command(benchmark: str, argv: list[str] | None = None) -> str:
    """The command as run: `python -m benchmarks.NAME` and its arguments, credentials redacted."""
    args, shown = list(sys.argv[1:] if argv is None else argv), []
    for i, arg in enumerate(args):
        flag, eq, _ = arg.partition("=")
        if eq and flag.startswith("--") and SECRET.fullmatch(flag[2:]):
            arg = f"{flag}={REDACTED}"
        elif i and args[i - 1].startswith("--") and SECRET.fullmatch(args[i - 1][2:]):
            arg = REDACTED
        shown.append(arg)
    return " ".join(["python -m benchmarks." + benchmark, *([shlex.join(shown)] if shown else [])])


def _redact(value):
    if isinstance(value, dict):
        return {k: REDACTED if SECRET.fullmatch(str(k)) and v is not None else _redact(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact(v) for v in value]
    return value


def write(benchmark: str, summary: dict, results: dict | None = None, *,
          argv: list[str] | None = None, name: str | None = None, path: Path | None = None) -> Path:
    """Write the results file of one run: `path`, or benchmarks/results/<name or benchmark>.json."""
    path = Path(path) if path is not None else RESULTS / f"{name or benchmark}.json"
    doc = {"benchmark": benchmark, "machine": machine(), "commit": commit(),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": command(benchmark, argv), "results": _redact(results or {}), "summary": summary}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"results: {path}", file=sys.stderr, flush=True)
    return path


def read(path: Path) -> dict:
    """A results file; ResultsFileError if it lacks any of FIELDS or is not JSON."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ResultsFileError(f"{path}: not JSON ({exc})") from exc
    missing = [f for f in FIELDS if not isinstance(doc, dict) or f not in doc]
    if missing:
        raise ResultsFileError(f"{path}: no {', '.join(missing)}")
    return doc
