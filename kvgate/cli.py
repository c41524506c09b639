"""`kvgate` command line. Subcommands import their heavy modules (torch, the engine) lazily, so
`kvgate --help` and the gateway never load torch.

    kvgate engine --model PATH_OR_DEFAULT --port P [engine flags]   one replica
    kvgate up                                                        the local default setup
    kvgate gateway --replica URL … [--redis-url URL] [--policy NAME]  one gateway
    kvgate picker --replica URL … --grpc-port P                      Envoy's endpoint picker (ext_proc)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Every flag comes from the fields of EngineConfig and ServerSettings (their defaults,
    help and choices), as vLLM builds its flags from EngineArgs."""
    from backend_engine.cli_args import add_cli_args
    from backend_engine.config import EngineConfig
    from backend_engine.server.settings import ServerSettings

    add_cli_args(p, EngineConfig)
    add_cli_args(p, ServerSettings)


def engine_config_from_args(args: argparse.Namespace):  # -> EngineConfig (imported lazily)
    from backend_engine.cli_args import from_cli_args
    from backend_engine.config import EngineConfig

    config = EngineConfig(**from_cli_args(EngineConfig, args))
    if args.served_model_names:  # the engine's own name (and hash namespace) is the first
        config.served_model_name = args.served_model_names[0]
    config.validate()
    return config


def server_settings_from_args(args: argparse.Namespace):  # -> ServerSettings
    from backend_engine.cli_args import from_cli_args
    from backend_engine.server.settings import API_KEY_ENV, ServerSettings

    settings = ServerSettings(**from_cli_args(ServerSettings, args))
    if settings.api_key is None and os.environ.get(API_KEY_ENV):
        settings.api_key = os.environ[API_KEY_ENV]
    if args.kv_events_config:
        from backend_engine.server.kv_events_config import KVEventsConfig

        KVEventsConfig.from_json(args.kv_events_config)  # a bad value stops start-up here
    return settings


def _run_engine(args: argparse.Namespace) -> int:
    from backend_engine import process_env

    process_env.set_process_defaults()  # before anything imports torch (libgomp reads it then)
    from backend_engine.server.launcher import serve

    try:
        config = engine_config_from_args(args)
    except ValueError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    try:
        settings = server_settings_from_args(args)
    except ValueError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    return serve(settings, config, on_ready=_print_usage)


def _print_usage(state) -> None:  # noqa: ANN001 - ServerState, imported lazily
    s = state.settings
    host = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host
    base_url = f"http://{host}:{s.port}/v1"
    model = state.served_model_names[0]
    # The key itself never reaches stdout, which is a log file under `kvgate up`.
    auth = ' -H "Authorization: Bearer $KVGATE_API_KEY"' if s.api_key else ""
    key = 'os.environ["KVGATE_API_KEY"]' if s.api_key else '"unused"'
    print(
        f"\nkvgate is ready. OpenAI base_url: {base_url}  (model: {model})\n\n"
        f"  curl {base_url}/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n\n"
        f"  from openai import OpenAI\n"
        f"  client = OpenAI(base_url=\"{base_url}\", api_key={key})\n",
        flush=True,
    )


class _KvEventsForReplica(argparse.Action):
    """`--kv-events SPEC` belongs to the `--replica URL` given just before it."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        if not namespace.replica:
            parser.error("--kv-events must follow the --replica URL it belongs to")
        setattr(namespace, self.dest, {**getattr(namespace, self.dest), namespace.replica[-1].rstrip("/"): values})


def _add_gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", default=[], metavar="URL", help="a replica's base URL (repeat for each)")
    p.add_argument("--kv-events", action=_KvEventsForReplica, default={}, metavar="SPEC",
                   help="after --replica URL: that replica's ZMQ KV events (vLLM, SGLang, or kvgate replicas "
                        "publishing them), tcp://HOST:5557[,replay=tcp://HOST:5558][,topic=T][,dp_size=N]")
    p.add_argument("--config", default=None, metavar="FILE", help="YAML/JSON config file (keys, limits, tokenizers, …)")
    p.add_argument("--redis-url", default=None, help="share routing state, keys and rate limits through Redis")
    p.add_argument("--policy", default=None, help="routing policy (prefix_cost, round_robin, least_load, …)")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--admin-key", default=None, help="the key for /admin and /admin/api (or KVGATE_ADMIN_KEY)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY", help="a user key for /v1/* (repeat)")
    p.add_argument("--isolate-cache-by-key", action="store_true", help="give every key its own cache namespace")
    p.add_argument("--tokenizer", action="append", default=[], metavar="MODEL=FOLDER",
                   help="the folder with the model's tokenizer.json (MODEL may be *); without it the "
                        "gateway loads the tokenizer kvgate replicas serve")
    p.add_argument("--no-replica-tokenizer", action="store_true",
                   help="fetch no tokenizer from kvgate replicas: models without --tokenizer are "
                        "tokenised through the least-loaded replica's /tokenize")
    p.add_argument("--max-in-flight", type=int, default=None, help="per-replica request cap (0: none)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests that may wait at the gateway while every replica refuses for load "
                        "(default 1024; 0: pass the 503 on)")
    p.add_argument("--max-queue-wait-s", type=float, default=None,
                   help="the longest a request waits there before a 503 (default 600)")
    p.add_argument("--migration-limit", type=int, default=None,
                   help="times a stream whose replica fails mid-way is continued on another replica "
                        "from the tokens already sent (default 1; 0: end it with an error event)")
    p.add_argument("--stream-stall-timeout-s", type=float, default=None,
                   help="a stream with no bytes for this long has failed and migrates (default 30; "
                        "0: wait up to read_timeout_s)")
    p.add_argument("--replica-engine", action="append", default=[], metavar="URL=ENGINE",
                   help="a foreign replica's engine (vllm, sglang, other): what it serves beyond plain "
                        "generation (structured outputs, tools, /v1/responses); kvgate replicas say it themselves")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _run_gateway(args: argparse.Namespace) -> int:
    from gateway.config import ConfigError
    from gateway.serve import config_from_args, serve_gateway

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    return serve_gateway(config)


def _run_picker(args: argparse.Namespace) -> int:
    from gateway.config import ConfigError
    from gateway.picker.service import serve_picker
    from gateway.serve import config_from_args

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    return serve_picker(config, f"{args.grpc_host}:{args.grpc_port}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="KV-cache-aware LLM gateway and engine")
    sub = parser.add_subparsers(dest="command", required=True)
    engine = sub.add_parser("engine", help="run one engine replica with its OpenAI-compatible server")
    _add_engine_flags(engine)
    up = sub.add_parser("up", help="run K replicas and G gateways on this machine, supervised (Ctrl-C stops all)")
    from kvgate.launcher.command import add_up_flags  # no torch: argparse only

    add_up_flags(up)
    gw = sub.add_parser("gateway", help="run a gateway in front of replicas")
    _add_gateway_flags(gw)
    picker = sub.add_parser("picker", help="route for Envoy: an ext_proc endpoint picker (Gateway API "
                                           "Inference Extension); --host/--port serve its admin API and metrics")
    _add_gateway_flags(picker)
    picker.add_argument("--grpc-host", default="127.0.0.1", help="interface of the ext_proc service (0.0.0.0: all)")
    picker.add_argument("--grpc-port", type=int, default=9002, help="TCP port of the ext_proc service")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "engine":
        return _run_engine(args)
    if args.command == "gateway":
        return _run_gateway(args)
    if args.command == "picker":
        return _run_picker(args)
    if args.command == "up":
        from kvgate.launcher.command import run_up

        return run_up(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
