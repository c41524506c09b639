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
    p.add_argument("--eviction-policy", default="slru", choices=["slru", "lru", "kvgate"],
                   help="free cached blocks: slru (segmented LRU) keeps reused prefixes over one-offs; "
                        "lru is plain LRU; kvgate is slru's deprecated name")
    p.add_argument("--max-pinned-fraction", type=float, default=0.25,
                   help="share of the KV pool pinned prefixes may hold (POST /admin/pins)")
    p.add_argument("--max-waiting", type=int, default=None, help="waiting-queue limit; beyond it requests get 503")
    load = p.add_argument_group("scheduling under load")
    load.add_argument("--target-itl-ms", type=float, default=None,
                      help="inter-token latency each step's prefill budget is sized for (default: 250 on CPU, "
                           "40 on CUDA; 0: a fixed --max-num-batched-tokens budget, no ITL target)")
    load.add_argument("--min-prefill-tokens", type=int, default=32,
                      help="prefill tokens a step carries at the least, so new requests progress")
    load.add_argument("--max-queue-delay-s", type=float, default=10.0,
                      help="answer 503 + Retry-After when a new request would wait longer than this for its "
                           "first token (0: never refuse)")
    p.add_argument("--scheduling-policy", default="priority", choices=["priority", "fcfs"],
                   help="priority: lower 'priority' values first (equal ones in arrival order); fcfs: arrival only")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute and KV-cache dtype; auto: bfloat16 where the device computes it "
                        "natively (CUDA, CPUs with AVX512-BF16/AMX), else float32")
    p.add_argument("--quantization", default=None, choices=["none", "int8", "int4", "awq", "gptq"],
                   help="weights: int8 (per channel) / int4 (group-wise) quantise at load, a GGUF's "
                        "tensors load directly; awq/gptq load such checkpoints (default: the "
                        "checkpoint's own, else none)")
    p.add_argument("--quantization-group-size", type=int, default=32, choices=[32, 64, 128],
                   help="int4 at load: input features per scale and min")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="processes (one per device: gloo on CPU, NCCL on CUDA) one replica spans")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", default=None, choices=["ngram", "draft"])
    spec.add_argument("--num-speculative-tokens", type=int, default=4)
    spec.add_argument("--ngram-min", type=int, default=2, help="shortest suffix the n-gram proposer matches")
    spec.add_argument("--ngram-max", type=int, default=4, help="longest suffix, tried first")
    spec.add_argument("--draft-model", default=None, help="for --speculative-method draft: a model sharing the tokenizer")
    spec.add_argument("--speculative-max-batch", type=int, default=4,
                      help="speculate only while at most this many sequences run")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='vLLM\'s KV event publisher config, e.g. \'{"enable_kv_cache_events": true, '
                        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'')
    pd = p.add_argument_group("prefill/decode disaggregation")
    pd.add_argument("--role", default="both", choices=["both", "prefill", "decode"],
                    help="prefill: compute prompts and send their KV blocks; decode: receive them and decode; "
                         "both: whole requests (default)")
    pd.add_argument("--kv-transfer-host", default=None, help="decode: where the KV receiver binds (default: --host)")
    pd.add_argument("--kv-transfer-port", type=int, default=0, help="decode: the KV receiver's port (0: a free one)")
    pd.add_argument("--kv-transfer-address", default=None, metavar="tcp://HOST:PORT",
                    help="decode: the address prefill replicas dial, when it differs from the bind address (NAT, pods)")
    pd.add_argument("--kv-transfer-timeout", type=float, default=10.0,
                    help="seconds of silence that fail a transfer; how long received blocks wait for their request")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json", "mistral"],
                   help="how tool calls are read from (and forced into) the model's output; auto: by its tokenizer")
    p.add_argument("--drain-grace", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    p.add_argument("--max-body-bytes", type=int, default=None, help="request body limit (413 beyond)")
    p.add_argument("--enforce-eager", action="store_true", help="compile nothing (start-up in seconds)")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a developer override of the execution plan (backend_engine/accel/plan.py)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _target_itl_ms(args: argparse.Namespace) -> float | None:
    if args.target_itl_ms is None:
        from backend_engine.step_budget import default_target_itl_ms

        return default_target_itl_ms(args.device)
    return args.target_itl_ms or None  # 0: no target


def engine_config_from_args(args: argparse.Namespace):  # -> EngineConfig (imported lazily)
    from backend_engine.config import EngineConfig
    from backend_engine.dtype import resolve_dtype

    config = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        dtype=resolve_dtype(args.dtype, args.device),
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
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
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        draft_model=args.draft_model,
        speculative_max_batch=args.speculative_max_batch,
        target_itl_ms=_target_itl_ms(args),
        min_prefill_tokens=args.min_prefill_tokens,
        max_queue_delay_s=args.max_queue_delay_s or None,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_role=args.role,
        kv_transfer_host=args.kv_transfer_host or args.host,
        kv_transfer_port=args.kv_transfer_port,
        kv_transfer_address=args.kv_transfer_address,
        kv_transfer_timeout_s=args.kv_transfer_timeout,
        enforce_eager=args.enforce_eager,
        engine_options=dict(o.split("=", 1) for o in args.engine_option),
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
        kv_events_config=args.kv_events_config,
        tool_call_parser=args.tool_call_parser,
    )
    if args.kv_events_config:
        from backend_engine.server.kv_publisher import KVEventsConfig

        KVEventsConfig.from_json(args.kv_events_config)  # a bad value stops start-up here
    if args.max_body_bytes is not None:
        settings.max_body_bytes = args.max_body_bytes
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
    auth = f' -H "Authorization: Bearer {s.api_key}"' if s.api_key else ""
    print(
        f"\nkvgate is ready. OpenAI base_url: {base_url}  (model: {model})\n\n"
        f"  curl {base_url}/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n\n"
        f"  from openai import OpenAI\n"
        f"  client = OpenAI(base_url=\"{base_url}\", api_key=\"{s.api_key or 'unused'}\")\n",
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
                   help="the folder with the model's tokenizer.json (MODEL may be *)")
    p.add_argument("--max-in-flight", type=int, default=None, help="per-replica request cap (0: none)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests that may wait at the gateway while every replica refuses for load "
                        "(default 1024; 0: pass the 503 on)")
    p.add_argument("--max-queue-wait-s", type=float, default=None,
                   help="the longest a request waits there before a 503 (default 600)")
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
