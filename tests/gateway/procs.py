"""Real processes for the gateway tests: tiny-model replicas (`kvgate engine`) and gateways
(`kvgate gateway`), each on a free loopback port, killed at the end of the module."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "admin-test-key"
MODEL = "tiny-random"
BLOCK = 16  # the replicas' and gateways' block size (their default)


def whole_blocks(cached_tokens: int) -> int:
    """The part of an engine's cached tokens a gateway can predict: whole blocks (a kvgate
    engine may serve part of the next one too: backend_engine/partial_block.py)."""
    return cached_tokens // BLOCK * BLOCK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokenizer_folder() -> str:
    from backend_engine.model_loader import resolve_model  # no torch: the folder exists already

    return str(resolve_model(MODEL).folder)


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None,
              status: int = 200) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer {status} within {timeout_s}s")


class Proc:
    def __init__(self, args: list[str], port: int, health: str, log_name: str) -> None:
        self.args, self.port, self.health = args, port, health
        self.log = Path(tempfile.gettempdir()) / f"kvgate-test-{log_name}-{port}.log"
        self.proc: subprocess.Popen | None = None
        self.module = "kvgate.cli"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True, timeout_s: float = 90.0) -> "Proc":
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args],
                                         cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if wait:
            wait_http(self.url + self.health, timeout_s, self.proc)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


def replica(port: int | None = None, *extra: str) -> Proc:
    """A tiny-model replica; `extra`: more `kvgate engine` flags (e.g. --kv-transfer-config JSON)."""
    port = port or free_port()
    return Proc(["engine", "--model", MODEL, "--port", str(port), "--num-kv-blocks", "256",
                 "--enforce-eager",  # tests of serving, not of the compiled plan
                 "--num-threads", "1", "--log-level", "warning",
                 "--dtype", "float32",  # outputs compared token for token across replicas
                 *extra], port, "/health", "replica")


def gateway(replica_urls: list[str], *extra: str, config: str | None = None,
            local_tokenizer: bool = True) -> Proc:
    """A gateway; without `local_tokenizer` it tokenises through the replicas' /tokenize."""
    port = free_port()
    args = ["gateway", "--port", str(port), "--admin-key", ADMIN_KEY, "--log-level", "warning"]
    if local_tokenizer:
        args += ["--tokenizer", f"{MODEL}={tokenizer_folder()}"]
    for url in replica_urls:
        args += ["--replica", url]
    if config is not None:
        args += ["--config", config]
    return Proc([*args, *extra], port, "/health", "gateway")


def fixture_upstream() -> Proc:
    """The benchmark fixture: an OpenAI-shaped server with fixed answers and no /kv endpoints."""
    port = free_port()
    proc = Proc([], port, "/health", "fixture")
    proc.module = "benchmarks.gateway_overhead"
    proc.args = ["--serve-fixture", "--port", str(port)]
    return proc


def start_all(procs: list[Proc], timeout_s: float = 120.0) -> None:
    """Start several processes at once (replicas load in parallel), then wait for each."""
    for p in procs:
        p.start(wait=False)
    for p in procs:
        wait_http(p.url + p.health, timeout_s, p.proc)


@contextlib.contextmanager
def two_replicas_and_gateway() -> Iterator[tuple[list[Proc], Proc]]:
    """Two tiny replicas and a gateway in front of them, stopped on exit."""
    replicas = [replica(), replica()]
    start_all(replicas)
    gw = gateway([r.url for r in replicas]).start()
    try:
        yield replicas, gw
    finally:
        for p in (gw, *replicas):
            p.stop()


def admin(gw: Proc, path: str, method: str = "GET", **kw) -> httpx.Response:
    return httpx.request(method, gw.url + "/admin/api" + path, timeout=10.0,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}, **kw)


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def long_system_prompt(tag: str, words: int = 240) -> str:
    return f"[{tag}] " + " ".join(f"rule{i} of the {tag} assistant is to be precise." for i in range(words // 8))
