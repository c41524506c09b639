"""vLLM's `--kv-events-config` (which publisher, where, how much to buffer), read at start-up
without the publisher's own dependencies (pyzmq, msgspec): a replica that publishes nothing
imports neither, and one asked to publish without them is refused before it loads a model."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, fields

# (module, the package that provides it)
PUBLISHER_MODULES = (("zmq", "pyzmq"), ("msgspec", "msgspec"))


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; default: zmq when events are enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"--kv-events-config: unknown fields {sorted(unknown)}")
        config = cls(**data)
        if config.publisher is None:
            config.publisher = "zmq" if config.enable_kv_cache_events else "null"
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: unknown publisher {config.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(config, name), int) or getattr(config, name) <= 0:
                raise ValueError(f"--kv-events-config: {name} must be a positive integer")
        missing = [pkg for module, pkg in PUBLISHER_MODULES
                   if importlib.util.find_spec(module) is None]
        if config.enabled and missing:
            raise ValueError(f"--kv-events-config enables a ZMQ publisher, which needs "
                             f"{' and '.join(missing)}: not installed on this replica")
        return config

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"
