"""Which child processes `kvgate up` runs: argv, environment, port and health check of each."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend_engine.cli_args import to_argv
from backend_engine.server.settings import API_KEY_ENV
from kvgate.launcher.config import REPLICA_SETTINGS, ConfigError, UpConfig
from kvgate.launcher.envoy import EnvoySettings, envoy_command

REPLICA, GATEWAY, REDIS, ENVOY = "replica", "gateway", "redis", "envoy"
DEFAULT_CPU_REPLICAS = 2


@dataclass(slots=True)
class ChildSpec:
    name: str  # replica-1, gateway-1, redis
    role: str  # REPLICA | GATEWAY | REDIS
    argv: list[str]
    port: int
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment
    kv_port: int | None = None  # a decode replica's KV receiver
    health_url: str | None = None  # None: url + "/health"

    @property
    def url(self) -> str:
        return f"http://{_client_host(self.host)}:{self.port}"


@dataclass(slots=True)
class Plan:
    redis: ChildSpec | None
    replicas: list[ChildSpec]
    gateways: list[ChildSpec]
    redis_url: str | None
    device: str  # cpu | cuda
    envoy: ChildSpec | None = None  # in front of the gateway, which is then Envoy's picker

    @property
    def children(self) -> list[ChildSpec]:
        """In start order: shared state first, then replicas, then the gateways that route to
        them (and Envoy, which asks the picker)."""
        return (([self.redis] if self.redis else []) + self.replicas + self.gateways
                + ([self.envoy] if self.envoy else []))


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def count_gpus() -> int:
    """GPUs that `nvidia-smi -L` lists; 0 without the tool or a driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def count_cores() -> int:
    """Cores this process may use (a container's CPU set, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def flags_from_mapping(values: dict[str, Any]) -> list[str]:
    """{'max_in_flight': 8, 'isolate_cache_by_key': True, 'tokenizer': [a, b]} → gateway argv."""
    argv: list[str] = []
    for name, value in values.items():
        flag = "--" + str(name).lstrip("-").replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def build_plan(config: UpConfig, gpus: int, cores: int, redis_port: int | None = None,
               python: str = sys.executable, tokenizer_folder: str | None = None) -> Plan:
    """tokenizer_folder: the served model's tokenizer, given to every gateway (`--tokenizer`)."""
    device = config.device if config.device != "auto" else ("cuda" if gpus else "cpu")
    if device == "cuda" and gpus == 0:
        raise ConfigError("device cuda asked for, but `nvidia-smi -L` lists no GPU")
    tp = config.tensor_parallel_size
    if device == "cuda" and gpus < tp:
        raise ConfigError(f"tensor_parallel_size {tp} needs {tp} GPUs per replica, but `nvidia-smi -L` "
                          f"lists {gpus}")
    p, d = config.prefill_replicas, config.decode_replicas
    if config.replicas is not None:
        k = config.replicas
    else:  # with P/D replicas, no whole-request ones unless asked for
        k = 0 if d else (gpus // tp if device == "cuda" else DEFAULT_CPU_REPLICAS)
    g = config.gateways
    redis = None
    redis_url = config.redis_url
    if config.wants_redis:
        redis = _redis_spec(redis_port or free_port())
        redis_url = f"redis://127.0.0.1:{redis.port}/0"
    roles = ["both"] * k + ["prefill"] * p + ["decode"] * d
    total = len(roles)
    kv_port = config.port + g + total  # decode replicas' KV receivers, after every HTTP port
    settings = config.replica_settings()
    replicas = []
    for i, role in enumerate(roles):
        own: dict[str, Any] = {}
        name = f"replica-{i + 1}"
        if role != "both":
            name = f"{role}-{roles[:i + 1].count(role)}"
            own["kv_role"] = role
        if role == "decode":
            own["kv_transfer_port"] = kv_port
            kv_port += 1
        if settings.get("kv_offload_dir"):  # each replica its own disk tier, kept across restarts
            own["kv_offload_dir"] = str(Path(settings["kv_offload_dir"]) / name)
        spec = _replica_spec(config, i, name, settings | own, device, gpus, cores, total, python)
        spec.kv_port = own.get("kv_transfer_port")
        replicas.append(spec)
    if config.envoy:
        picker = _gateway_spec(config, 0, free_port(config.host), replicas, redis_url, python,
                               tokenizer_folder, grpc_port=free_port(config.host))
        return Plan(redis, replicas, [picker], redis_url, device, _envoy_spec(config, picker, replicas))
    gateways = [_gateway_spec(config, i, config.port + i, replicas, redis_url, python,
                              tokenizer_folder) for i in range(g)]
    return Plan(redis, replicas, gateways, redis_url, device)


def _replica_spec(config: UpConfig, i: int, name: str, settings: dict[str, Any], device: str,
                  gpus: int, cores: int, k: int, python: str) -> ChildSpec:
    """settings: the replica's EngineConfig / ServerSettings fields (UpConfig.replica_settings
    and its role); its command line is what `kvgate engine` parses back into them."""
    port = config.port + config.gateways + i
    own: dict[str, Any] = {"host": config.host, "port": port, "device": device,
                           "log_level": config.log_level}
    env: dict[str, str] = {}
    tp = config.tensor_parallel_size
    if device == "cuda":
        # tp GPUs per replica (one per rank); with more replicas than that allows they share round-robin.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str((i * tp + rank) % gpus) for rank in range(tp))
    else:
        # Several torch processes that each use every core collapse (25x slower, measured):
        # split the cores between the replicas' processes (tp per replica) instead.
        threads = config.num_threads or max(1, cores // (k * tp))
        own["num_threads"] = threads
        env["OMP_NUM_THREADS"] = str(threads)
    if tp > 1:
        own["tensor_parallel_size"] = tp
    if config.api_key and config.gateways == 0:  # no gateway in front: the replicas check the key
        env[API_KEY_ENV] = config.api_key  # never on the command line, where `ps` shows it
    if "drain_grace_s" not in settings:  # a replica must drain before the supervisor's SIGKILL
        own["drain_grace_s"] = max(1.0, config.shutdown_grace_s - 3.0)
    argv = [python, "-m", "kvgate.cli", "engine", *to_argv(REPLICA_SETTINGS, {**settings, **own})]
    return ChildSpec(name, REPLICA, argv, port, config.host, env)


def _gateway_spec(config: UpConfig, i: int, port: int, replicas: list[ChildSpec], redis_url: str | None,
                  python: str, tokenizer_folder: str | None = None, grpc_port: int | None = None) -> ChildSpec:
    """A gateway; with `grpc_port`, Envoy's endpoint picker (`kvgate picker`: the same flags,
    and its ext_proc service on that port)."""
    command = "gateway" if grpc_port is None else "picker"
    argv = [python, "-m", "kvgate.cli", command, "--host", config.host, "--port", str(port)]
    if grpc_port is not None:
        argv += ["--grpc-host", config.host, "--grpc-port", str(grpc_port)]
    for replica in replicas:
        argv += ["--replica", replica.url]
    if redis_url:
        argv += ["--redis-url", redis_url]
    if config.policy:
        argv += ["--policy", config.policy]
    env = gateway_key_env(config.admin_key, config.api_key)  # never on the command line
    if tokenizer_folder and "tokenizer" not in config.gateway:
        argv += ["--tokenizer", f"*={tokenizer_folder}"]  # the one model every replica serves
    argv += flags_from_mapping(config.gateway)
    return ChildSpec(f"gateway-{i + 1}" if grpc_port is None else "picker", GATEWAY, argv, port,
                     config.host, env)


def _envoy_spec(config: UpConfig, picker: ChildSpec, replicas: list[ChildSpec]) -> ChildSpec:
    """Envoy at the first gateway's port, asking `picker` (its argv names the gRPC port)."""
    grpc_port = int(picker.argv[picker.argv.index("--grpc-port") + 1])
    admin_port = free_port("127.0.0.1")
    # the picker's queue wait (a `gateway:` flag), which Envoy must be willing to wait for
    wait = next((v for k, v in config.gateway.items()
                 if str(k).lstrip("-").replace("-", "_") == "max_queue_wait_s"), None)
    settings = EnvoySettings(f"{_client_host(config.host)}:{grpc_port}", [r.url for r in replicas],
                             host=config.host, port=config.port, admin_port=admin_port,
                             **({} if wait is None else {"queue_wait_s": float(wait)}))
    try:
        argv = envoy_command(settings)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    return ChildSpec("envoy", ENVOY, argv, config.port, config.host,
                     health_url=f"http://127.0.0.1:{admin_port}/ready")


def gateway_key_env(admin_key: str | None, api_key: str | None) -> dict[str, str]:
    """A gateway's keys as its environment (gateway/config.py apply_env reads them): only the
    user who runs `kvgate up` can read a process's environment, while anyone can read its
    command line. User keys already in the environment are kept beside the new one."""
    env: dict[str, str] = {}
    if admin_key:
        env["KVGATE_ADMIN_KEY"] = admin_key
    if api_key:
        env["KVGATE_API_KEYS"] = ",".join(k for k in (os.environ.get("KVGATE_API_KEYS"), api_key) if k)
    return env


def _redis_spec(port: int) -> ChildSpec:
    exe = shutil.which("redis-server")
    if exe is None:
        raise ConfigError("several gateways share state in Redis: install redis-server "
                          "(apt-get install redis-server) or pass --redis-url")
    # A throwaway store: loopback only, nothing written to disk.
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--protected-mode", "yes", "--loglevel", "warning"]
    return ChildSpec("redis", REDIS, argv, port)
