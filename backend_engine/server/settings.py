"""What the replica's HTTP server needs to know beyond the engine's own config; each field's
flag is declared beside its default (backend_engine/cli_args.py), as EngineConfig's are."""

from __future__ import annotations

from dataclasses import dataclass

from backend_engine.cli_fields import JsonConfig, setting
from backend_engine.reasoning import CHOICES as REASONING_PARSERS
from protocol.http import DEFAULT_MAX_BODY_BYTES

SERVER = "server"
API_KEY_ENV = "KVGATE_API_KEY"  # the replica's key when --api-key is not given
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
STRUCTURED_OUTPUTS_CONFIG = JsonConfig(
    "structured_outputs_config",
    'structured outputs, in vLLM\'s keys: \'{"disable_any_whitespace": false}\' lets JSON '
    "answers (json_schema, json_object, forced tool calls) hold pretty whitespace")


@dataclass(slots=True)
class ServerSettings:
    host: str = setting("127.0.0.1", "interface to listen on (0.0.0.0: all)")
    port: int = setting(8000, "TCP port to listen on")
    served_model_names: list[str] = setting(
        factory=list, help="names clients use (the first is the canonical one; default: the "
        "model's name)", flag="--served-model-name", nargs="+", metavar="NAME")
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY' on /v1/* (or "
                                  f"{API_KEY_ENV}, which `ps` does not show)")
    max_body_bytes: int = setting(DEFAULT_MAX_BODY_BYTES, "request body limit (413 beyond)",
                                  group=SERVER)
    drain_grace_s: float = setting(30.0, "seconds in-flight requests get after SIGTERM",
                                   flag="--drain-grace", metavar="SECONDS",
                                   group=SERVER)
    kv_heartbeat_s: float = setting(1.0, "/kv/events: heartbeat (with load) after this much "
                                    "quiet", via="")
    retry_after_s: int = setting(1, "Retry-After on 503 (loading, draining, queue full)", via="")
    log_level: str = setting("info", "uvicorn and engine logging", choices=LOG_LEVELS,
                             group=SERVER)
    kv_events_config: str | None = setting(
        None, 'vLLM\'s KV event publisher config, e.g. \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'',
        metavar="JSON")
    tool_call_parser: str = setting("auto", "how tool calls are read from (and forced into) the "
                                    "model's output; auto: by its tokenizer",
                                    choices=TOOL_CALL_PARSERS)
    reasoning_parser: str = setting(
        "auto", "how reasoning (<think>…</think>) is split from the answer into "
        "reasoning_content; auto: by the chat template where it is unambiguous; none: off",
        choices=REASONING_PARSERS)
    disable_any_whitespace: bool = setting(
        True, "JSON answers are compact, as OpenAI writes them (true), or may hold at most a "
        "space or a newline and 16 of indentation between tokens (false); a request's "
        "structured_outputs.disable_any_whitespace overrides it", json=STRUCTURED_OUTPUTS_CONFIG)
