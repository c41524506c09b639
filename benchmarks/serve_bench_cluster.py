"""A private cluster for `--compare-policies`, started through `kvgate up`'s own planner and
supervisor (kvgate.launcher), so the benchmark measures exactly what users run."""

from __future__ import annotations

import random
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvgate.launcher.config import UpConfig
from kvgate.launcher.plan import DEFAULT_CPU_REPLICAS, build_plan, count_cores, port_is_free
from kvgate.launcher.supervisor import Supervisor
from kvgate.launcher.tokenizer import tokenizer_folder


@dataclass(slots=True)
class ClusterSpec:
    replicas: int = 4
    gateways: int = 1
    policy: str = "prefix_cost"
    model: str = "default"
    num_kv_blocks: int = 256
    num_threads: int = 1  # 4 replicas on 2 cores: one torch thread each, never oversubscribed
    max_num_seqs: int = 16
    enforce_eager: bool = False  # True: replicas start without compiling (a smoke run's quick start)


def _free_base_port(count: int, host: str = "127.0.0.1") -> int:
    """A random base with `count` consecutive free ports (gateways, then replicas)."""
    for _ in range(200):
        base = random.randrange(20_000, 60_000 - count)
        if all(port_is_free(host, base + i) for i in range(count)):
            return base
    raise RuntimeError("no run of free loopback ports found")


def bench_config(spec: ClusterSpec, log_dir: Path) -> UpConfig:
    """The `kvgate up` configuration of a benchmark cluster described by `spec`."""
    return UpConfig(
        model=spec.model, replicas=spec.replicas, gateways=spec.gateways, policy=spec.policy,
        device="cpu", num_threads=spec.num_threads, enforce_eager=spec.enforce_eager,
        engine={"num_kv_blocks": spec.num_kv_blocks, "max_num_seqs": spec.max_num_seqs},
        # Stopping between policies should be quick; nothing is in flight by then.
        shutdown_grace_s=5.0, health_timeout_s=300.0, log_dir=str(log_dir), log_level="warning")


class Cluster:
    """Context manager: replicas (+ Redis) + gateways up and healthy inside, all stopped after.
    Give a ClusterSpec (the benchmark's small cluster) or a whole UpConfig (e.g. `kvgate up`'s
    defaults); the ports are chosen here."""

    def __init__(self, spec: ClusterSpec | UpConfig, log_root: Path | None = None,
                 say=print) -> None:
        self.spec = spec
        self.say = say
        self.log_dir = Path(tempfile.mkdtemp(prefix="serve-bench-", dir=log_root))
        self.config = spec if isinstance(spec, UpConfig) else bench_config(spec, self.log_dir)
        self.config.log_dir = str(self.log_dir)
        self.config.port = _free_base_port(
            (self.config.replicas or DEFAULT_CPU_REPLICAS) + self.config.gateways)
        # Our own keys: UpConfig.fill_keys' token_urlsafe admin key starts with "-" one time in
        # 64, and the gateway's argparse then takes it for a flag and exits.
        self.config.admin_key = self.config.admin_key or "admin-" + secrets.token_hex(16)
        if self.config.gateways > 1 and self.config.api_key is None:
            self.config.api_key = "sk-bench-" + secrets.token_hex(16)
        self.config.validate()
        self.config.fill_keys()  # admin key always; a user key when gateways share Redis
        self.plan = build_plan(self.config, gpus=0, cores=count_cores(),
                               tokenizer_folder=tokenizer_folder(self.config.model,
                                                                 self.config.quantization))
        self.supervisor: Supervisor | None = None

    @property
    def base_urls(self) -> list[str]:
        return [g.url + "/v1" for g in self.plan.gateways]

    @property
    def gateway_urls(self) -> list[str]:
        return [g.url for g in self.plan.gateways]

    @property
    def replica_urls(self) -> list[str]:
        return [r.url for r in self.plan.replicas]

    @property
    def api_key(self) -> str | None:
        return self.config.api_key

    @property
    def admin_key(self) -> str | None:
        return self.config.admin_key

    def __enter__(self) -> "Cluster":
        self.supervisor = Supervisor(self.plan, self.config, self.log_dir, lambda m: None)
        self.supervisor.check_ports()
        try:
            if not self.supervisor.start():
                tails = {c.spec.name: c.log_tail(5) for c in self.supervisor.children}
                raise RuntimeError(f"cluster did not become healthy; logs in {self.log_dir}: {tails}")
        except BaseException:
            self.supervisor.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
