"""`kvgate gateway`: build the config from file, environment and flags, then serve."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from gateway.config import ApiKey, ConfigError, GatewayConfig, apply_env, load_file, validate


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    config = GatewayConfig()
    if args.config:
        load_file(args.config, config)
    apply_env(config)
    config.replicas += args.replica
    config.kv_events.update(getattr(args, "kv_events", None) or {})
    for name in ("redis_url", "policy", "host", "port", "admin_key", "max_in_flight",
                 "max_queued_requests", "max_queue_wait_s", "migration_limit",
                 "stream_stall_timeout_s"):
        value = getattr(args, name)
        if value is not None:
            setattr(config, name, value)
    if args.isolate_cache_by_key:
        config.isolate_cache_by_key = True
        for key in config.api_keys:
            key.isolate_cache = True
    for i, key in enumerate(args.api_key):
        config.api_keys.append(ApiKey(key, f"cli-{i}", isolate_cache=config.isolate_cache_by_key))
    for item in args.tokenizer:
        model, sep, folder = item.partition("=")
        if not sep or not model or not folder:
            raise ConfigError(f"--tokenizer wants MODEL=FOLDER, got {item!r}")
        config.tokenizers[model] = folder
    for item in args.replica_engine:
        url, sep, engine = item.rpartition("=")
        if not sep or not url or not engine:
            raise ConfigError(f"--replica-engine wants URL=ENGINE, got {item!r}")
        config.replica_engines[url.rstrip("/")] = engine
    if getattr(args, "no_replica_tokenizer", False):
        config.replica_tokenizer = False
    config.log_level = args.log_level
    if not config.replicas:
        raise ConfigError("give at least one --replica URL (or `replicas:` in the config file)")
    return validate(config)


def serve_gateway(config: GatewayConfig) -> int:
    from gateway.app import create_app

    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call is noise
    app = create_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                timeout_graceful_shutdown=5, access_log=False,
                timeout_keep_alive=75)  # longer than clients' and load balancers' idle pools
    return 0
