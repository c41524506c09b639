"""The environment a process that runs the engine starts with: OpenMP's spin and where Inductor
keeps its compiled code. Importing this module (or `backend_engine`) changes nothing; the entry
points (`kvgate engine`, the test suite, the benchmarks) call `set_process_defaults()` first."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

# How long an idle OpenMP worker spins before it sleeps. A decode step is hundreds of small
# parallel regions, each of which wakes the workers: sleeping workers (OMP_WAIT_POLICY=PASSIVE)
# pay a futex round trip at every wake, which makes a one-sequence step much slower, while long
# spins (libgomp's default, 300,000) collapse when another process holds a core, since a
# spinning worker then eats the time slice of the thread it waits for. A short spin keeps most
# of the first gain and bounds the second (benchmarks/results/history/measurements.md, "OpenMP
# waiters"). An explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT is left as it is: a replica with
# cores of its own can spin longer (GOMP_SPINCOUNT=300000, libgomp's default), a crowded
# machine can sleep.
OPENMP_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
DEFAULT_SPINCOUNT = "1000"


def cache_root() -> Path:
    """Where kvgate keeps what it builds once: converted weights (`models/`) and Inductor's
    compiled code (`inductor/<code digest>/`). `KVGATE_CACHE_DIR`, else ~/.cache/kvgate."""
    return Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate"))


def set_process_defaults() -> None:
    """Set kvgate's defaults where the user set nothing. Call it before torch is imported:
    libgomp reads its spin count once, when torch loads it."""
    if not any(name in os.environ for name in OPENMP_SETTINGS):
        os.environ["GOMP_SPINCOUNT"] = DEFAULT_SPINCOUNT
    # Inductor's kernels and graphs (the decode step, attention, the GEMM templates) go with the
    # weights, not to torch's default /tmp/torchinductor_<user>, which many systems empty at
    # boot: a replica's start-up would then compile everything again, several times slower than
    # from the cache. vLLM keeps its own under ~/.cache/vllm likewise.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache())


def inductor_cache() -> Path:
    """Inductor's folder under the cache root, one per version of the code it compiles (a digest
    of accel/ and models/): its cache keys do not cover a custom op's fake implementation, so an
    op whose output dtype changed was loaded compiled for the old one (NaN logits)."""
    digest = hashlib.blake2b(digest_size=6)
    here = Path(__file__).parent
    for path in sorted([*(here / "accel").rglob("*.py"), *(here / "models").rglob("*.py")]):
        digest.update(path.relative_to(here).as_posix().encode())
        digest.update(path.read_bytes())
    return cache_root() / "inductor" / digest.hexdigest()
