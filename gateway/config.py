"""Gateway configuration: one dataclass, filled from a YAML/JSON file, then the environment,
then command-line flags (later sources win)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gateway.kv_events_spec import KvEventsSpecError, parse_kv_events
from protocol.common import MAX_PRIORITY, MIN_PRIORITY
from protocol.features import ENGINE_FEATURES


class ConfigError(ValueError):
    """The configuration cannot be used (unknown field, bad value, missing file)."""


@dataclass(slots=True)
class ApiKey:
    key: str
    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    isolate_cache: bool = False  # the key gets its own cache namespace (tenant isolation)
    priority: int = 0  # the request priority when the request gives none (lower: more urgent)
    max_priority: int | None = None  # the most urgent (smallest) value it may ask for; None: any


@dataclass(slots=True)
class GatewayConfig:
    replicas: list[str] = field(default_factory=list)  # base URLs of the replicas (kvgate, vLLM, SGLang, …)
    kv_events: dict[str, str] = field(default_factory=dict)  # replica URL -> ZMQ spec (--kv-events)
    host: str = "127.0.0.1"  # interface to listen on (0.0.0.0: all)
    port: int = 8080  # TCP port to listen on
    redis_url: str | None = None  # share routing state, keys, rate limits and pins through Redis
    policy: str = "prefix_cost"  # a name in routing.policies.REGISTRY (prefix_cost, round_robin, …)
    admin_key: str | None = None  # bearer key for /admin and /admin/api; None: generated (file logged)
    api_keys: list[ApiKey] = field(default_factory=list)  # user keys for /v1/*; none anywhere: open
    isolate_cache_by_key: bool = False  # default for keys that do not say
    redis_keys: bool = False  # also accept keys stored in Redis (hash kvgate:keys)
    tokenizers: dict[str, str] = field(default_factory=dict)  # model -> folder with tokenizer.json
    replica_tokenizer: bool = True  # else: fetch no tokenizer from kvgate replicas (/tokenizer/bundle)
    block_size: int = 16  # tokens per hashed block; equal to the engines' block size
    # replica URL -> its engine ("kvgate", "vllm", "sglang", "other"): what a foreign replica
    # serves (structured outputs, tools, /v1/responses); unlisted replicas are asked (model cards)
    replica_engines: dict[str, str] = field(default_factory=dict)
    max_attempts: int = 3  # replicas tried per request before the first byte
    migration_limit: int = 1  # continuations of one stream on other replicas after it broke; 0: none
    # a stream silent this long has failed (0: read_timeout_s) — unless its replica, asked, says
    # the request is still advancing or queued there (gateway/stall_probe.py)
    stream_stall_timeout_s: float = 30.0
    stream_stall_probe_timeout_s: float = 2.0  # no answer to that question within it: hung
    retry_backoff_s: float = 0.02  # base of the jittered backoff between attempts
    health_interval_s: float = 1.0  # seconds between GET /health of every replica
    failure_threshold: int = 3  # consecutive failures that open a replica's circuit
    circuit_cooldown_s: float = 5.0  # an open circuit waits this long before one trial request
    max_in_flight: int = 0  # per replica, across gateways when Redis is shared; 0 = unlimited
    max_queued_requests: int = 1024  # wait here when every replica refuses for load; 0: refuse
    max_queue_wait_s: float = 600.0  # the longest a request waits here before its 503
    # a queued request waits this long at most for the replica holding its prefix, while that
    # replica stays inside the policy's load window, before it takes any replica with room
    overload_affinity_s: float = 2.0
    lease_s: float = 30.0  # a booking in Redis expires unless its gateway renews it (lease_s / 3)
    approx_capacity_blocks: int = 8192  # LRU size for replicas without KV events
    connect_timeout_s: float = 2.0  # TCP connect to a replica
    read_timeout_s: float = 600.0  # longest silence between two bytes of a replica's answer
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    max_messages: int = 2048  # more messages in one chat request get 400
    max_prompt_tokens: int = 131072  # longer prompts get 400 before any replica is asked
    decisions_kept: int = 500  # routing decisions kept for /admin/api/decisions
    prefix_advice: bool = True  # watch prompts for volatile fields that defeat the cache
    # prefill/decode pairs (replicas started with --kv-transfer-config kv_role prefill / decode)
    pd_bypass_tokens: int = 64  # the decode replica prefills itself when it lacks at most this
    pd_transfer_weight: float = 0.25  # cost of a transferred prompt token, in computed tokens
    seed: int | None = None  # seeds the policies' random tie-breaks (tests, benchmarks)
    log_level: str = "info"  # uvicorn and gateway logging


_SCALARS = {name for name in GatewayConfig.__dataclass_fields__
            if name not in ("replicas", "kv_events", "api_keys", "tokenizers", "replica_engines")}


def _api_key(raw: dict | str, i: int, isolate_default: bool) -> ApiKey:
    if isinstance(raw, str):
        return ApiKey(raw, f"key-{i}", isolate_cache=isolate_default)
    if not isinstance(raw, dict) or not isinstance(raw.get("key"), str):
        raise ConfigError(f"api_keys[{i}] needs a string 'key'")
    unknown = set(raw) - {"key", "name", "rpm", "tpm", "isolate_cache", "priority", "max_priority"}
    if unknown:
        raise ConfigError(f"api_keys[{i}]: unknown fields {sorted(unknown)}")
    key = ApiKey(raw["key"], str(raw.get("name") or f"key-{i}"), raw.get("rpm"), raw.get("tpm"),
                 bool(raw.get("isolate_cache", isolate_default)), raw.get("priority", 0),
                 raw.get("max_priority"))
    try:
        check_key_priority(key.priority, key.max_priority)
    except ValueError as exc:
        raise ConfigError(f"api_keys[{i}]: {exc}") from None
    return key


def _replica_entry(entry: object, i: int, config: GatewayConfig) -> str:
    """A replica URL, or `{url: URL, kv_events: "tcp://HOST:5557,replay=tcp://HOST:5558"}`."""
    if isinstance(entry, str):
        return entry
    if not isinstance(entry, dict) or not isinstance(entry.get("url"), str) \
            or set(entry) - {"url", "kv_events"}:
        raise ConfigError(f"replicas[{i}] must be a URL or a mapping with 'url' (and 'kv_events')")
    if entry.get("kv_events"):
        config.kv_events[entry["url"].rstrip("/")] = str(entry["kv_events"])
    return entry["url"]


def check_key_priority(priority: object, max_priority: object) -> None:
    """A key's default priority and bound: integers in range, the default within the bound."""
    for name, value in (("priority", priority), ("max_priority", max_priority)):
        if value is None and name == "max_priority":
            continue
        if not isinstance(value, int) or isinstance(value, bool) \
                or not MIN_PRIORITY <= value <= MAX_PRIORITY:
            raise ValueError(f"'{name}' must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]")
    if max_priority is not None and priority < max_priority:
        raise ValueError(f"the default 'priority' {priority} is more urgent than the key's "
                         f"'max_priority' {max_priority}")


def load_file(path: str | Path, config: GatewayConfig) -> GatewayConfig:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping")
    unknown = set(data) - _SCALARS - {"replicas", "api_keys", "tokenizers", "replica_engines"}
    if unknown:
        raise ConfigError(f"config file {path}: unknown fields {sorted(unknown)}")
    for name in _SCALARS & set(data):
        setattr(config, name, data[name])
    for i, entry in enumerate(data.get("replicas") or []):
        config.replicas.append(_replica_entry(entry, i, config))
    config.tokenizers.update(data.get("tokenizers") or {})
    config.replica_engines.update({url.rstrip("/"): engine for url, engine
                                   in (data.get("replica_engines") or {}).items()})
    config.api_keys += [_api_key(k, i, config.isolate_cache_by_key)
                        for i, k in enumerate(data.get("api_keys") or [])]
    return config


def apply_env(config: GatewayConfig, env: dict[str, str] | None = None) -> GatewayConfig:
    """KVGATE_ADMIN_KEY, KVGATE_API_KEYS (comma separated), KVGATE_REDIS_URL."""
    env = os.environ if env is None else env
    if env.get("KVGATE_ADMIN_KEY"):
        config.admin_key = env["KVGATE_ADMIN_KEY"]
    if env.get("KVGATE_REDIS_URL"):
        config.redis_url = env["KVGATE_REDIS_URL"]
    for i, key in enumerate(k for k in env.get("KVGATE_API_KEYS", "").split(",") if k.strip()):
        config.api_keys.append(ApiKey(key.strip(), f"env-{i}", isolate_cache=config.isolate_cache_by_key))
    return config


def validate(config: GatewayConfig) -> GatewayConfig:
    for url, spec in config.kv_events.items():
        try:
            parse_kv_events(spec)
        except KvEventsSpecError as exc:
            raise ConfigError(f"replica {url}: {exc}") from None
    if config.max_attempts < 1:
        raise ConfigError("max_attempts must be at least 1")
    if config.migration_limit < 0 or config.stream_stall_timeout_s < 0:
        raise ConfigError("migration_limit and stream_stall_timeout_s must not be negative")
    if config.stream_stall_probe_timeout_s <= 0:
        raise ConfigError("stream_stall_probe_timeout_s must be positive")
    if config.lease_s <= 0:
        raise ConfigError("lease_s must be positive")
    if config.failure_threshold < 1:
        raise ConfigError("failure_threshold must be at least 1")
    if config.overload_affinity_s < 0:
        raise ConfigError("overload_affinity_s must be >= 0 (0: no affinity in the overload queue)")
    if config.max_queued_requests < 0 or config.max_queue_wait_s <= 0:
        raise ConfigError("max_queued_requests must be >= 0 and max_queue_wait_s positive")
    if config.pd_bypass_tokens < 0 or config.pd_transfer_weight < 0:
        raise ConfigError("pd_bypass_tokens and pd_transfer_weight must not be negative")
    bad = {u: e for u, e in config.replica_engines.items() if e not in ENGINE_FEATURES}
    if bad:
        raise ConfigError(f"replica_engines: unknown engines {bad}; choose from "
                          f"{sorted(ENGINE_FEATURES)}")
    names = [k.name for k in config.api_keys]
    if any("|" in name for name in names):
        raise ConfigError("api key names may not contain '|' (it separates tenant and salt)")
    if len(set(names)) != len(names):
        raise ConfigError("api key names must be unique")
    if config.admin_key is not None and any(k.key == config.admin_key for k in config.api_keys):
        raise ConfigError("the admin key must differ from every user key")
    return config
