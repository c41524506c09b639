"""What the replica's HTTP server needs to know beyond the engine's own config."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.http import DEFAULT_MAX_BODY_BYTES


@dataclass(slots=True)
class ServerSettings:
    host: str = "127.0.0.1"  # interface to listen on (0.0.0.0: all)
    port: int = 8000  # TCP port to listen on
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model_id
    api_key: str | None = None  # bearer key required on /v1/* when set
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    drain_grace_s: float = 30.0  # SIGTERM: how long in-flight requests may still run
    kv_heartbeat_s: float = 1.0  # /kv/events: heartbeat (with load) after this much quiet
    retry_after_s: int = 1  # Retry-After on 503 (loading, draining, queue full)
    log_level: str = "info"  # uvicorn and engine logging
    kv_events_config: str | None = None  # vLLM's --kv-events-config JSON: publish KV events on ZMQ
    tool_call_parser: str = "auto"  # "auto" (by the model's tokenizer) | "hermes" | "llama3_json" | "mistral"
