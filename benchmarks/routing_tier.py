"""The two routing tiers the Envoy benchmark compares, as processes on loopback in front of the
same replicas: kvgate's own gateway (`kvgate gateway`, one Python process that proxies every
byte), and Envoy with `kvgate picker` as its ext_proc endpoint picker (Envoy moves the bytes,
the picker only chooses). Each tier knows its processes, so the CPU time it spent can be read
from /proc."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.gateway_overhead import _wait
from kvgate.launcher.envoy import EnvoySettings, envoy_command
from kvgate.launcher.plan import free_port

_TICK = os.sysconf("SC_CLK_TCK")
START_TIMEOUT_S = 180.0  # a busy shared machine starts Python processes slowly


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and all its threads so far (its children excluded)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


class Tier:
    """Context manager: the tier's processes started and ready inside, stopped after."""

    name = ""

    def __init__(self, replica_urls: list[str], tokenizer: str, policy: str = "prefix_cost",
                 api_key: str | None = None) -> None:
        self.replica_urls, self.tokenizer, self.policy, self.api_key = replica_urls, tokenizer, policy, api_key
        self.admin_key = "admin-" + secrets.token_hex(8)
        self.procs: dict[str, subprocess.Popen] = {}
        self.log = Path(tempfile.mkdtemp(prefix=f"kvgate-bench-{self.name}-")) / "tier.log"
        self.url = ""  # the OpenAI base, without /v1
        self.admin_url = ""  # the gateway's (or picker's) HTTP app: admin API, metrics

    def _kvgate(self, command: str, port: int, *extra: str) -> subprocess.Popen:
        args = [sys.executable, "-m", "kvgate.cli", command, "--port", str(port), "--policy", self.policy,
                "--tokenizer", self.tokenizer, "--admin-key", self.admin_key, "--log-level", "warning"]
        for url in self.replica_urls:
            args += ["--replica", url]
        if self.api_key:
            args += ["--api-key", self.api_key]
        return self._spawn(command, [*args, *extra])

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        with open(self.log, "ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        raise NotImplementedError

    def overload_queue(self) -> dict:
        """The tier's overload queue so far (the gateway's, or the picker's flow control)."""
        return httpx.get(self.admin_url + "/admin/api/summary", timeout=10,
                         headers={"Authorization": f"Bearer {self.admin_key}"}).json()["overload_queue"]

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of each of the tier's processes, by name."""
        return {name: cpu_seconds(p.pid) for name, p in self.procs.items()}

    def __enter__(self) -> "Tier":
        try:
            self.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs.values()):
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class GatewayTier(Tier):
    name = "gateway"

    def start(self) -> None:
        port = free_port()
        proc = self._kvgate("gateway", port)
        self.url = self.admin_url = f"http://127.0.0.1:{port}"
        _wait(self.url + "/health", proc, START_TIMEOUT_S)


class EnvoyTier(Tier):
    name = "envoy"

    def __init__(self, *args, envoy_concurrency: int = 1, response_body: str = "STREAMED", **kw) -> None:
        super().__init__(*args, **kw)
        self.envoy_concurrency, self.response_body = envoy_concurrency, response_body

    def start(self) -> None:
        http_port, grpc_port = free_port(), free_port()
        picker = self._kvgate("picker", http_port, "--grpc-port", str(grpc_port))
        self.admin_url = f"http://127.0.0.1:{http_port}"
        _wait(self.admin_url + "/health", picker, START_TIMEOUT_S)
        port, admin_port = free_port(), free_port()
        settings = EnvoySettings(f"127.0.0.1:{grpc_port}", self.replica_urls, port=port,
                                 admin_port=admin_port, response_body=self.response_body)
        envoy = self._spawn("envoy", envoy_command(settings, self.envoy_concurrency))
        _wait(f"http://127.0.0.1:{admin_port}/ready", envoy, START_TIMEOUT_S)
        self.url = f"http://127.0.0.1:{port}"
