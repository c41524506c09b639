"""A local cluster whose processes the fault scenarios may kill, pause and restart one by one:
tiny-model replicas, gateways and Redis, planned exactly as `kvgate up` plans them
(kvgate.launcher) but not supervised, so a killed child stays dead until a scenario restarts it."""

from __future__ import annotations

import json
import secrets
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serve_bench_cluster import _free_base_port
from kvgate.launcher.child import Child
from kvgate.launcher.config import UpConfig
from kvgate.launcher.health import probe
from kvgate.launcher.plan import build_plan, count_cores

MODEL = "tiny-random"
MAX_BODY_BYTES = 8 * 1024 * 1024  # the gateway's default, given to the replicas too


@dataclass(slots=True)
class ClusterSpec:
    replicas: int = 2
    gateways: int = 2
    redis: bool = True
    num_kv_blocks: int = 256
    max_num_seqs: int = 32
    # The scenarios measure what faults lose and how routing recovers, on the tiny model; its
    # compiled graphs would only slow every replica's (re)start.
    enforce_eager: bool = True
    engine: dict[str, Any] = field(default_factory=dict)  # more replica settings (UpConfig.engine)
    # Gateway settings that make faults visible within seconds rather than minutes.
    gateway: dict[str, Any] = field(default_factory=lambda: {
        "health_interval_s": 0.5, "failure_threshold": 2, "circuit_cooldown_s": 1.0,
        "max_attempts": 3, "read_timeout_s": 30.0, "lease_s": 3.0, "stream_stall_timeout_s": 5.0,
        "migration_limit": 1})
    api_keys: list[dict] = field(default_factory=list)  # `api_keys:` of the gateway config


def tokenizer_folder() -> str:
    from backend_engine.model_loader import resolve_model  # no torch: the folder exists already

    return str(resolve_model(MODEL).folder)


class LocalCluster:
    """Context manager: every process healthy inside, all stopped (SIGTERM, then SIGKILL) after."""

    def __init__(self, spec: ClusterSpec, log_root: Path | None = None) -> None:
        self.spec = spec
        self.log_dir = Path(tempfile.mkdtemp(prefix="kvgate-reliability-", dir=log_root))
        gateway_config = self.log_dir / "gateway.yaml"
        gateway_config.write_text(json.dumps({**spec.gateway, "api_keys": spec.api_keys,
                                              "tokenizers": {MODEL: tokenizer_folder()}}))
        self.admin_key = "admin-" + secrets.token_hex(16)
        config = UpConfig(
            model=MODEL, replicas=spec.replicas, gateways=spec.gateways, redis=spec.redis,
            port=_free_base_port(spec.replicas + spec.gateways), device="cpu", num_threads=1,
            enforce_eager=spec.enforce_eager,
            # float32: scenarios compare greedy answers across batch compositions, which bf16
            # rounding (`--dtype auto` on AVX512-BF16 CPUs) may change
            engine={"num_kv_blocks": spec.num_kv_blocks, "max_num_seqs": spec.max_num_seqs,
                    "dtype": "float32", "drain_grace_s": 2.0, "max_body_bytes": MAX_BODY_BYTES, **spec.engine},
            gateway={"config": str(gateway_config)}, admin_key=self.admin_key,
            log_dir=str(self.log_dir), log_level="info")
        config.validate()
        self.plan = build_plan(config, gpus=0, cores=count_cores())
        self.children = {c.name: Child(c, self.log_dir / f"{c.name}.log") for c in self.plan.children}

    # -- names and addresses -------------------------------------------------------------
    @property
    def replicas(self) -> list[Child]:
        return [self.children[s.name] for s in self.plan.replicas]

    @property
    def gateways(self) -> list[Child]:
        return [self.children[s.name] for s in self.plan.gateways]

    @property
    def redis(self) -> Child | None:
        return self.children.get("redis")

    def replica_by_address(self, host_port: str) -> Child:
        """The replica a gateway names `host:port` (its `x-kvgate-replica` header)."""
        return next(r for r in self.replicas if r.spec.url == "http://" + host_port)

    # -- life cycle ----------------------------------------------------------------------
    def __enter__(self) -> "LocalCluster":
        try:
            self.start([c for c in self.children.values() if c.spec.role != "gateway"])
            self.start(self.gateways)
        except BaseException:
            self.stop_all()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(self, children: list[Child], timeout_s: float = 180.0) -> None:
        for child in children:
            child.start()
        deadline = time.monotonic() + timeout_s
        for child in children:
            while not probe(child.spec).healthy:
                if child.exit_code() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{child.spec.name} did not become healthy: {child.log_tail(5)}")
                time.sleep(0.2)

    def kill(self, child: Child) -> None:
        """SIGKILL: the process and its group die at once, nothing is cleaned up."""
        child.signal_group(signal.SIGKILL)
        if child.proc is not None:
            child.proc.wait(timeout=10)

    def pause(self, child: Child) -> None:
        """SIGSTOP: the kernel still accepts connections, nothing answers them."""
        child.signal_group(signal.SIGSTOP)

    def resume(self, child: Child) -> None:
        child.signal_group(signal.SIGCONT)

    def restart(self, child: Child) -> None:
        if child.running():
            self.kill(child)
        self.start([child])

    def stop_all(self) -> None:
        for child in reversed(list(self.children.values())):  # gateways, replicas, Redis
            child.signal_group(signal.SIGCONT)
            child.signal_group(signal.SIGTERM)
        for child in self.children.values():
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - whatever is left gets SIGKILL
                child.signal_group(signal.SIGKILL)
                child.proc.wait(timeout=10)

    # -- observations --------------------------------------------------------------------
    def admin(self, gateway: Child, path: str) -> Any:
        return self.admin_call(gateway, "GET", path)

    def admin_call(self, gateway: Child, method: str, path: str, payload: dict | None = None) -> Any:
        r = httpx.request(method, gateway.spec.url + "/admin/api" + path, json=payload, timeout=10,
                          headers={"Authorization": f"Bearer {self.admin_key}"})
        r.raise_for_status()
        return r.json()

    def replica_rows(self, gateway: Child) -> dict[str, dict]:
        return {row["name"]: row for row in self.admin(gateway, "/replicas")["data"]}

    def engine_load(self, replica: Child) -> dict:
        return httpx.get(replica.spec.url + "/kv/snapshot", timeout=10).json()["load"]

    def rss_mb(self) -> dict[str, float]:
        """Resident memory of every running replica and gateway, in MB."""
        return {c.spec.name: _rss_mb(c.pid) for c in (*self.replicas, *self.gateways)
                if c.running() and c.pid is not None}

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob("*.log")))


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1) -> float | None:
    """Seconds until `predicate()` held, or None if it never did within `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if predicate():
                return time.monotonic() - t0
        except (httpx.HTTPError, KeyError):
            pass
        time.sleep(interval_s)
    return None
