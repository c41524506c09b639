"""--quantization reaches EngineConfig from `kvgate engine`, and every replica from `kvgate up`
(flag or config file), as do the plan's developer overrides (--engine-option); bad values are
refused naming the flag or key."""

from pathlib import Path

import pytest

from kvgate.cli import build_parser, engine_config_from_args
from kvgate.launcher.command import config_from_args
from kvgate.launcher.config import ConfigError
from kvgate.launcher.plan import build_plan


def _up(*argv: str):
    return config_from_args(build_parser().parse_args(["up", *argv]))


def argv_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_engine_flag_sets_the_method_and_group_size():
    args = build_parser().parse_args(["engine", "--quantization", "int4",
                                      "--quantization-group-size", "32"])
    config = engine_config_from_args(args)
    assert (config.quantization, config.quantization_group_size) == ("int4", 32)
    assert engine_config_from_args(build_parser().parse_args(["engine"])).quantization is None


def test_plan_overrides_reach_the_config_from_the_engine_flag_and_up(tmp_path):
    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["engine"])).engine_options == {}
    args = parse(["engine", "--quantization", "int8", "--engine-option", "decode=kernel",
                  "--engine-option", "lm_head=int4"])
    assert engine_config_from_args(args).engine_options == {"decode": "kernel", "lm_head": "int4"}
    path = tmp_path / "up.yaml"
    path.write_text("quantization: int8\nengine: {engine_options: {decode: kernel}}\n")
    for replica in build_plan(_up("--config", str(path)), gpus=0, cores=2).replicas:
        argv = replica.argv
        assert argv_values(argv, "--engine-option") == ["decode=kernel"]
        assert argv[argv.index("--quantization") + 1] == "int8"


def test_engine_flag_refuses_unknown_methods(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engine", "--quantization", "fp4"])
    assert "--quantization" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["flag", "file"])
def test_up_passes_the_method_to_every_replica(tmp_path, source):
    if source == "flag":
        config = _up("--quantization", "int4", "--replicas", "3")
    else:
        path = tmp_path / "up.yaml"
        path.write_text("quantization: int4\nreplicas: 3\n")
        config = _up("--config", str(path))
    plan = build_plan(config, gpus=0, cores=6)
    for replica in plan.replicas:
        assert replica.argv[replica.argv.index("--quantization") + 1] == "int4"


def test_up_without_the_key_passes_no_flag():
    assert all("--quantization" not in r.argv for r in build_plan(_up(), gpus=0, cores=2).replicas)


@pytest.mark.parametrize("text,message", [
    ("quantization: fp4\n", "quantization: 'fp4' is not one of none, int8, int4, awq, gptq"),
    ("quantization: int4\nengine:\n  quantization: int8\n", "top-level key `quantization`")])
def test_up_config_refuses_bad_quantization(tmp_path, text, message):
    path = tmp_path / "up.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        _up("--config", str(path))


@pytest.mark.parametrize("quantization,weights", [(None, False), ("none", True)])
def test_up_resolves_the_tokenizer_folder_as_its_replicas_will(quantization, weights):
    """A GGUF served as stored: the gateways' tokenizer folder is the replicas' own (config and
    tokenizer only), not a dequantised copy of the weights converted for nothing."""
    from backend_engine.model_loader import gguf_source, resolve_model
    from kvgate.launcher.tokenizer import tokenizer_folder

    folder = Path(tokenizer_folder("default", quantization))
    assert (folder / "tokenizer.json").is_file()
    assert (gguf_source(folder) is None) is weights
    assert folder == resolve_model("default", "int4" if quantization is None else "none").folder
