"""`kvgate` command line. Subcommands import their heavy modules (torch, the engine) lazily, so
`kvgate --help` and the gateway never load torch.

    kvgate engine --model PATH_OR_DEFAULT --port P [engine flags]   one replica
    kvgate up                                                        the local default setup
    kvgate gateway --replica URL … [--redis-url URL] [--policy NAME]  one gateway
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

DEFAULT_PORT = 8000


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help='"default" (SmolLM2-135M-Instruct), an HF folder, a .gguf file, or "tiny-random"')
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--served-model-name", nargs="+", default=None, help="names clients use (the first is the canonical one)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--block-size", type=int, default=16)
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks")
    kv.add_argument("--kv-cache-memory", type=float, default=None, help="KV cache size in GiB (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--eviction-policy", default="kvgate", choices=["kvgate", "lru"],
                   help="free cached blocks: kvgate keeps reused prefixes over one-offs; lru is plain LRU")
    p.add_argument("--max-pinned-fraction", type=float, default=0.25,
                   help="share of the KV pool pinned prefixes may hold (POST /admin/pins)")
    p.add_argument("--max-waiting", type=int, default=None, help="waiting-queue limit; beyond it requests get 503")
    p.add_argument("--scheduling-policy", default="priority", choices=["priority", "fcfs"],
                   help="priority: lower 'priority' values first (equal ones in arrival order); fcfs: arrival only")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: Triton kernels on CUDA, torch elsewhere")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", default=None, choices=["ngram", "draft"])
    spec.add_argument("--num-speculative-tokens", type=int, default=4)
    spec.add_argument("--ngram-min", type=int, default=2, help="shortest suffix the n-gram proposer matches")
    spec.add_argument("--ngram-max", type=int, default=4, help="longest suffix, tried first")
    spec.add_argument("--draft-model", default=None, help="for --speculative-method draft: a model sharing the tokenizer")
    spec.add_argument("--speculative-max-batch", type=int, default=4,
                      help="speculate only while at most this many sequences run")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json", "mistral"],
                   help="how tool calls are read from (and forced into) the model's output; auto: by its tokenizer")
    p.add_argument("--drain-grace", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    p.add_argument("--max-body-bytes", type=int, default=None, help="request body limit (413 beyond)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def engine_config_from_args(args: argparse.Namespace):  # -> EngineConfig (imported lazily)
    from backend_engine.config import EngineConfig

    config = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        eviction_policy=args.eviction_policy,
        max_pinned_fraction=args.max_pinned_fraction,
        max_waiting=args.max_waiting,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
        num_threads=args.num_threads,
        attention_backend=args.attention_backend,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        draft_model=args.draft_model,
        speculative_max_batch=args.speculative_max_batch,
    )
    if args.kv_cache_memory is not None:
        config.kv_cache_memory_gb = args.kv_cache_memory
    config.validate()
    return config


def server_settings_from_args(args: argparse.Namespace):  # -> ServerSettings
    from backend_engine.server.settings import ServerSettings

    settings = ServerSettings(
        host=args.host, port=args.port, served_model_names=list(args.served_model_name or []),
        api_key=args.api_key, drain_grace_s=args.drain_grace, log_level=args.log_level,
        tool_call_parser=args.tool_call_parser,
    )
    if args.max_body_bytes is not None:
        settings.max_body_bytes = args.max_body_bytes
    return settings


def _run_engine(args: argparse.Namespace) -> int:
    from backend_engine.server.launcher import serve

    try:
        config = engine_config_from_args(args)
    except ValueError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    settings = server_settings_from_args(args)
    return serve(settings, config, on_ready=_print_usage)


def _print_usage(state) -> None:  # noqa: ANN001 - ServerState, imported lazily
    s = state.settings
    host = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host
    base_url = f"http://{host}:{s.port}/v1"
    model = state.served_model_names[0]
    auth = f' -H "Authorization: Bearer {s.api_key}"' if s.api_key else ""
    print(
        f"\nkvgate is ready. OpenAI base_url: {base_url}  (model: {model})\n\n"
        f"  curl {base_url}/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n\n"
        f"  from openai import OpenAI\n"
        f"  client = OpenAI(base_url=\"{base_url}\", api_key=\"{s.api_key or 'unused'}\")\n",
        flush=True,
    )


def _add_gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", default=[], metavar="URL", help="a replica's base URL (repeat for each)")
    p.add_argument("--config", default=None, metavar="FILE", help="YAML/JSON config file (keys, limits, tokenizers, …)")
    p.add_argument("--redis-url", default=None, help="share routing state, keys and rate limits through Redis")
    p.add_argument("--policy", default=None, help="routing policy (kvgate, round_robin, least_load, …)")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--admin-key", default=None, help="the key for /admin and /admin/api (or KVGATE_ADMIN_KEY)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY", help="a user key for /v1/* (repeat)")
    p.add_argument("--isolate-cache-by-key", action="store_true", help="give every key its own cache namespace")
    p.add_argument("--tokenizer", action="append", default=[], metavar="MODEL=FOLDER",
                   help="the folder with the model's tokenizer.json (MODEL may be *)")
    p.add_argument("--max-in-flight", type=int, default=None, help="per-replica request cap (0: none)")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "engine":
        return _run_engine(args)
    if args.command == "gateway":
        return _run_gateway(args)
    if args.command == "up":
        from kvgate.launcher.command import run_up

        return run_up(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
