"""`kvgate` command line: flags are built from EngineConfig's and ServerSettings' fields, so their
defaults are the dataclasses' and `LLM()` builds the same engine; heavy imports are lazy."""

import argparse
import dataclasses
import json
import re
import subprocess
import sys

import pytest

from backend_engine.cli_args import from_cli_args, to_argv
from backend_engine.cli_fields import settings
from backend_engine.config import EngineConfig
from backend_engine.server.settings import ServerSettings
from kvgate.cli import build_parser, engine_config_from_args, server_settings_from_args


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_engine_flags_map_to_config_and_settings():
    args = parse("engine", "--model", "tiny-random", "--port", "9001", "--block-size", "32", "--num-kv-blocks", "64",
                 "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--max-model-len", "256",
                 "--no-prefix-caching", "--max-waiting", "5", "--served-model-name", "name", "alias",
                 "--api-key", "k", "--host", "0.0.0.0", "--drain-grace", "3")
    config = engine_config_from_args(args)
    assert (config.model, config.block_size, config.num_kv_blocks, config.max_num_seqs) == ("tiny-random", 32, 64, 8)
    assert (config.max_num_batched_tokens, config.max_model_len, config.max_waiting) == (128, 256, 5)
    assert config.enable_prefix_caching is False and config.served_model_name == "name"
    settings = server_settings_from_args(args)
    assert settings.served_model_names == ["name", "alias"] and settings.api_key == "k"
    assert (settings.host, settings.port, settings.drain_grace_s) == ("0.0.0.0", 9001, 3.0)


def test_kv_cache_memory_flag():
    assert engine_config_from_args(parse("engine", "--kv-cache-memory", "0.25")).kv_cache_memory_gb == 0.25


def test_up_defaults_to_the_default_model_on_port_8000():
    args = parse("up")
    assert (args.model, args.port) == ("default", 8000)


def test_help_does_not_load_torch():
    code = "import sys; from kvgate.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
    assert subprocess.run([sys.executable, "-m", "kvgate.cli", "--help"], capture_output=True).returncode == 0


def test_invalid_config_exits_2_and_missing_model_exits_1():
    bad = subprocess.run([sys.executable, "-m", "kvgate.cli", "engine", "--block-size", "3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "block_size" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "kvgate.cli", "engine", "--model", "/no/such/model", "--port", "0",
                              "--log-level", "error"], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1


def test_tensor_parallel_size_flag_reaches_the_config_and_is_checked():
    assert engine_config_from_args(parse("engine", "--tensor-parallel-size", "3")).tensor_parallel_size == 3
    assert engine_config_from_args(parse("engine", "-tp", "2")).tensor_parallel_size == 2
    bad = subprocess.run([sys.executable, "-m", "kvgate.cli", "engine", "-tp", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "tensor_parallel_size must be at least 1" in bad.stderr


def engine_parser():
    return next(a for a in build_parser()._actions if a.dest == "command").choices["engine"]


def test_the_parsers_defaults_are_the_dataclasses_defaults():
    """One source of defaults: `kvgate engine` with no flags builds EngineConfig() exactly."""
    args = parse("engine")
    assert engine_config_from_args(args) == EngineConfig()
    assert server_settings_from_args(args) == ServerSettings()


def test_llm_and_kvgate_engine_build_the_same_config(monkeypatch):
    import backend_engine.llm as llm_module

    built = []
    monkeypatch.setattr(llm_module, "LLMEngine", built.append)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm_module.LLM("tiny-random", num_kv_blocks=64, speculative_config=spec,
                   engine_options={"compiled": "off"})
    cli = engine_config_from_args(parse(
        "engine", "--model", "tiny-random", "--num-kv-blocks", "64", "--speculative-config",
        json.dumps(spec), "--engine-option", "compiled=off"))
    assert built == [cli] and cli.ngram_min == 1


def _other_value(s):
    """A value of the field's type other than its default."""
    if s.kind is bool:
        return not s.default
    if s.meta.choices:
        return next(c for c in s.meta.choices if c != s.default)
    if s.kind in (int, float):
        return (s.default or 0) * 2 + (2 if s.kind is int else 0.5)
    return {str: "other", list: ["a", "b"], dict: {"compiled": "off", "plan": "reference"}}[s.kind]


@pytest.mark.parametrize("cls", [EngineConfig, ServerSettings])
def test_every_field_is_reachable_from_the_command_line_or_says_how(cls):
    fields = settings(cls)
    assert [s.name for s in fields] == [f.name for f in dataclasses.fields(cls)]  # all declared
    for s in fields:
        if s.meta.via is not None:  # another flag sets it, or "" for Python only (documented)
            continue
        value = _other_value(s)
        argv = to_argv([cls], {s.name: value})
        assert from_cli_args(cls, parse("engine", *argv))[s.name] == value, argv
    assert engine_config_from_args(parse("engine", "--served-model-name", "a", "b")) \
        .served_model_name == "a"


def test_the_main_options_are_about_twenty_that_vllm_users_know():
    parser = engine_parser()
    main = next(g for g in parser._action_groups if g.title == "options")
    flags = {a.option_strings[0] for a in main._group_actions if a.help != argparse.SUPPRESS} - {"-h"}
    assert 18 <= len(flags) <= 24, sorted(flags)
    assert {"--model", "--served-model-name", "--host", "--port", "--api-key", "--dtype",
            "--quantization", "--device", "--block-size", "--max-model-len", "--max-num-seqs",
            "--max-num-batched-tokens", "--enable-prefix-caching", "--seed",
            "--tensor-parallel-size", "--kv-events-config", "--tool-call-parser",
            "--scheduling-policy", "--enforce-eager", "--speculative-config",
            "--kv-transfer-config"} <= flags
    shown = parser.format_help()
    assert "--engine-option KEY=VALUE" in shown and "developer overrides" in shown


@pytest.mark.parametrize("flag", ["--quantized-prefill", "--quantized-decode", "--compile-attention",
                                  "--compile-layers", "--lm-head-quantization", "--attention-backend",
                                  "--speculative-method", "--role"])
def test_the_plan_flags_and_the_old_grouped_flags_are_gone(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse("engine", flag, "auto")
    assert exit_.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (("--speculative-config", "{nope"), "argument --speculative-config: not valid JSON"),
    (("--speculative-config", '{"method": "ngram", "k": 3}'),
     r"argument --speculative-config: unknown key\(s\) k; known: method, num_speculative_tokens"),
    (("--speculative-config", '{"num_speculative_tokens": "many"}'),
     "argument --speculative-config: num_speculative_tokens: 'many' is not an integer"),
    (("--kv-transfer-config", '{"kv_role": "sender"}'),
     "argument --kv-transfer-config: kv_role: 'sender' is not one of both, prefill, decode"),
    (("--kv-transfer-config", "[1]"), "argument --kv-transfer-config: expected a JSON object"),
    (("--engine-option", "compiled"), "argument --engine-option: expected KEY=VALUE"),
    (("--target-itl-ms", "fast"), "argument --target-itl-ms: 'fast' is not a number"),
    (("--reasoning-parser", "deepseek"),
     "argument --reasoning-parser: 'deepseek' is not one of auto, none, deepseek_r1, qwen3"),
    (("--structured-outputs-config", '{"disable_any_whitespace": "sometimes"}'),
     "argument --structured-outputs-config: disable_any_whitespace: 'sometimes' is not true or false"),
    (("--structured-outputs-config", '{"backend": "outlines"}'),
     r"argument --structured-outputs-config: unknown key\(s\) backend; known: disable_any_whitespace"),
])
def test_bad_flag_values_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse("engine", *argv)
    assert exit_.value.code == 2 and re.search(message, capsys.readouterr().err)


def test_structured_outputs_config_and_reasoning_parser_take_vllms_names():
    settings = server_settings_from_args(parse("engine", "--reasoning-parser", "deepseek_r1",
                                               "--structured-outputs-config",
                                               '{"disable_any_whitespace": false}'))
    assert settings.reasoning_parser == "deepseek_r1" and settings.disable_any_whitespace is False
    defaults = server_settings_from_args(parse("engine"))
    assert defaults.reasoning_parser == "auto" and defaults.disable_any_whitespace is True


def test_speculative_config_takes_vllms_keys():
    draft = engine_config_from_args(parse("engine", "--speculative-config", json.dumps(
        {"method": "draft", "model": "tiny-random", "num_speculative_tokens": 2,
         "disable_by_batch_size": 8})))
    assert (draft.speculative_method, draft.draft_model, draft.num_speculative_tokens,
            draft.speculative_max_batch) == ("draft", "tiny-random", 2, 8)
    ngram = engine_config_from_args(parse("engine", "--speculative-config", json.dumps(
        {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3})))
    assert (ngram.speculative_method, ngram.ngram_min, ngram.ngram_max) == ("ngram", 1, 3)
    with pytest.raises(ValueError, match="needs draft_model"):  # then EngineConfig's own checks
        engine_config_from_args(parse("engine", "--speculative-config", '{"method": "draft"}'))


@pytest.mark.parametrize("role, ours", [("kv_producer", "prefill"), ("kv_consumer", "decode"),
                                        ("kv_both", "both"), ("prefill", "prefill"),
                                        ("decode", "decode")])
def test_kv_transfer_config_takes_vllms_roles_and_ours(role, ours):
    config = engine_config_from_args(parse("engine", "--kv-transfer-config", json.dumps(
        {"kv_role": role, "kv_ip": "0.0.0.0", "kv_port": 8200, "kv_timeout_s": 2})))
    assert (config.kv_role, config.kv_transfer_host, config.kv_transfer_port,
            config.kv_transfer_timeout_s) == (ours, "0.0.0.0", 8200, 2.0)


def test_prefix_caching_switches_and_engine_options():
    for flag in ("--no-enable-prefix-caching", "--no-prefix-caching"):
        assert engine_config_from_args(parse("engine", flag)).enable_prefix_caching is False
    config = engine_config_from_args(parse("engine", "--enforce-eager", "--engine-option",
                                           "plan=reference", "--engine-option", "decode=int8:kernel"))
    assert config.enforce_eager and config.engine_options == {"plan": "reference",
                                                              "decode": "int8:kernel"}


def test_device_defaults_stay_auto_until_the_engine_starts():
    config = engine_config_from_args(parse("engine", "--device", "cuda"))
    assert (config.dtype, config.target_itl_ms) == ("auto", None)
    assert engine_config_from_args(parse("engine", "--target-itl-ms", "0")).target_itl_ms == 0
    assert engine_config_from_args(parse("engine", "--max-queue-delay-s", "none")) \
        .max_queue_delay_s is None
