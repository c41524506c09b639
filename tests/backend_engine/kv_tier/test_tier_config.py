"""The KV tier's flags: declared once in EngineConfig, so `kvgate engine`, `kvgate up` and
`LLM()` agree; sizes in GiB or with a unit; what is refused."""

import pytest

from backend_engine.config import EngineConfig, gib
from kvgate.cli import build_parser, engine_config_from_args
from kvgate.launcher.command import config_from_args
from kvgate.launcher.plan import build_plan


def test_sizes_are_gib_or_carry_a_unit():
    assert gib("8") == 8.0 and gib("512MiB") == 0.5 and gib("2GB") == pytest.approx(2e9 / 2**30)
    with pytest.raises(ValueError):
        gib("3 parsecs")


def test_kvgate_engine_flags_set_the_tier():
    args = build_parser().parse_args(["engine", "--kv-offload-size", "512MiB", "--kv-offload-dir",
                                      "/tmp/kv", "--kv-offload-disk-size", "64"])
    config = engine_config_from_args(args)
    assert (config.kv_offload_size_gb, config.kv_offload_dir, config.kv_offload_disk_size_gb) \
        == (0.5, "/tmp/kv", 64.0)
    assert config.kv_offload_enabled and not EngineConfig().kv_offload_enabled


def test_kvgate_up_gives_each_replica_its_own_disk_tier(tmp_path):
    path = tmp_path / "up.yaml"
    path.write_text(f"engine:\n  kv_offload_dir: {tmp_path}\n  kv_offload_size_gb: 1GiB\n")
    config = config_from_args(build_parser().parse_args(
        ["up", "--replicas", "2", "--config", str(path)]))
    plan = build_plan(config, gpus=0, cores=2)
    folders = []
    for spec in plan.replicas:
        args = build_parser().parse_args(spec.argv[3:])
        engine = engine_config_from_args(args)
        assert engine.kv_offload_size_gb == 1.0
        folders.append(engine.kv_offload_dir)
    assert folders == [str(tmp_path / "replica-1"), str(tmp_path / "replica-2")]


@pytest.mark.parametrize("bad, message", [
    (dict(kv_offload_size_gb=-1), "must not be negative"),
    (dict(kv_offload_size_gb=1, enable_prefix_caching=False), "needs prefix caching"),
])
def test_what_a_tier_refuses(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**bad).validate()
