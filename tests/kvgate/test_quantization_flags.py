"""--quantization reaches EngineConfig from `kvgate engine`, and every replica from `kvgate up`
(flag or config file); bad values are refused naming the flag or key."""

import pytest

from kvgate.cli import build_parser, engine_config_from_args
from kvgate.launcher.command import config_from_args
from kvgate.launcher.config import ConfigError
from kvgate.launcher.plan import build_plan


def _up(*argv: str):
    return config_from_args(build_parser().parse_args(["up", *argv]))


def test_engine_flag_sets_the_method_and_group_size():
    args = build_parser().parse_args(["engine", "--quantization", "int4",
                                      "--quantization-group-size", "32"])
    config = engine_config_from_args(args)
    assert (config.quantization, config.quantization_group_size) == ("int4", 32)
    assert engine_config_from_args(build_parser().parse_args(["engine"])).quantization is None


def test_engine_flag_sets_the_lm_head_format():
    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["engine"])).lm_head_quantization == "w8a8"
    for method in ("w8a8", "int8", "int4"):
        args = parse(["engine", "--quantization", "int4", "--lm-head-quantization", method])
        assert engine_config_from_args(args).lm_head_quantization == method


def test_engine_flag_sets_the_decode_form_and_up_passes_it(tmp_path, capsys):
    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["engine"])).quantized_decode == "auto"
    for form in ("auto", "kernel", "template"):
        args = parse(["engine", "--quantization", "int8", "--quantized-decode", form])
        assert engine_config_from_args(args).quantized_decode == form
    path = tmp_path / "up.yaml"
    path.write_text("quantization: int8\nengine: {quantized_decode: kernel}\n")
    for replica in build_plan(_up("--config", str(path)), gpus=0, cores=2).replicas:
        assert replica.argv[replica.argv.index("--quantized-decode") + 1] == "kernel"
    with pytest.raises(SystemExit):
        parse(["engine", "--quantized-decode", "sometimes"])
    assert "--quantized-decode" in capsys.readouterr().err


def test_up_passes_the_lm_head_format_from_the_engine_section(tmp_path):
    path = tmp_path / "up.yaml"
    path.write_text("quantization: int4\nengine: {lm_head_quantization: int4}\n")
    for replica in build_plan(_up("--config", str(path)), gpus=0, cores=2).replicas:
        assert replica.argv[replica.argv.index("--lm-head-quantization") + 1] == "int4"


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


def test_engine_section_may_carry_it_too():
    config = _up("--quantization", "int4")
    config.engine = {"quantization": "int4"}
    argv = build_plan(config, gpus=0, cores=2).replicas[0].argv
    assert argv.count("--quantization") == 1


def test_up_without_the_key_passes_no_flag():
    assert all("--quantization" not in r.argv for r in build_plan(_up(), gpus=0, cores=2).replicas)


@pytest.mark.parametrize("text,message", [
    ("quantization: fp4\n", "quantization must be one of"),
    ("quantization: int4\nengine:\n  quantization: int8\n", "disagree")])
def test_up_config_refuses_bad_quantization(tmp_path, text, message):
    path = tmp_path / "up.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        _up("--config", str(path))
