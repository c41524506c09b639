"""`kvgate::int8_gemm`: exact int8 x int8 → int32 matrix products, the integer sums of `w8a8`.

On x86 with AVX2 the sums come from a kernel of our own (csrc/int8_gemm_avx2.c), built with the
system's C compiler on first use into `~/.cache/kvgate/kernels` (`KVGATE_KERNEL_DIR`), keyed by
the source's and the compiler's hash, and called through ctypes (the GIL released). It exists
because torch's int8 GEMMs either saturate or crawl on a CPU without VNNI: oneDNN's and
FBGEMM's u8 x s8 kernels sum pairs of products in 16 bits, which overflow for 8-bit
activations, and `torch._int_mm` runs a reference loop, many times slower. Elsewhere (another
architecture, no compiler) the sums come from `torch._int_mm`. Integer sums are exact, so either
gives the same bits, and so does oneDNN's VNNI kernel on the classes that have it (kernels.py):
a `w8a8` lm_head answers alike on every CPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from backend_engine.dtype import cpu_flags

log = logging.getLogger("kvgate.engine")

SOURCE = Path(__file__).parent / "csrc" / "int8_gemm_avx2.c"
CFLAGS = ("-O3", "-mavx2", "-fopenmp", "-shared", "-fPIC")


def kernel_dir() -> Path:
    return Path(os.environ.get("KVGATE_KERNEL_DIR")
                or Path.home() / ".cache" / "kvgate" / "kernels")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(compiler: str, directory: Path) -> Path:
    """The kernel's shared library, compiled once per source and compiler (atomically: a
    replica starting beside another never loads a half-written file)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(CFLAGS).encode())
    path = directory / f"int8_gemm_avx2-{key.hexdigest()[:16]}.so"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            out = Path(tmp) / path.name
            subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", str(out)], check=True,
                           capture_output=True, text=True)
            os.replace(out, path)
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The AVX2 kernel, loaded; None where it cannot run or be built (said once in the log)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or "avx2" not in cpu_flags():
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler: w8a8's integer sums run torch._int_mm (exact, slower)")
        return None
    try:
        lib = ctypes.CDLL(str(build(compiler, kernel_dir())))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("the AVX2 int8 kernel did not build (%s): w8a8's integer sums run "
                    "torch._int_mm (exact, slower)", str(detail).strip()[:300])
        return None
    lib.kvgate_int8_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6 + [ctypes.c_int]
    lib.kvgate_int8_gemm.restype = None
    return lib


@torch.library.custom_op("kvgate::int8_gemm", mutates_args=())
def int8_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] with values in [-127, 127] times b int8 [N, K] (transposed) → int32
    [M, N], exact."""
    lib = library()
    if lib is None:
        return torch._int_mm(a, b.t())
    a, b = a.contiguous(), b.contiguous()
    (m, k), n = a.shape, b.shape[0]
    c = torch.empty(m, n, dtype=torch.int32)
    lib.kvgate_int8_gemm(a.data_ptr(), b.data_ptr(), c.data_ptr(), m, n, k, k, k, n,
                         torch.get_num_threads())
    return c


@int8_gemm.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[0], dtype=torch.int32)
