"""`kvgate up` configuration and plan: flags over file over defaults, the port layout, the
per-replica thread split, GPU pinning, and Redis only when gateways share state."""

from __future__ import annotations

import dataclasses
import os
import stat

import pytest

from kvgate.cli import build_parser, engine_config_from_args, server_settings_from_args
from backend_engine.config import EngineConfig
from kvgate.launcher.command import config_from_args
from kvgate.launcher.config import ConfigError, UpConfig
from kvgate.launcher.plan import build_plan, count_gpus
from kvgate.launcher.supervisor import restart_delay


def config_for(*argv: str) -> UpConfig:
    return config_from_args(build_parser().parse_args(["up", *argv]))


def argv_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def replica_config(argv: list[str]):
    """What the replica's `kvgate engine` makes of the command line the plan gave it."""
    assert argv[1:4] == ["-m", "kvgate.cli", "engine"]
    args = build_parser().parse_args(argv[3:])
    return engine_config_from_args(args), server_settings_from_args(args)


def test_typed_flags_override_the_file_and_the_file_overrides_defaults(tmp_path):
    path = tmp_path / "up.yaml"
    path.write_text("port: 9000\nreplicas: 3\nmodel: tiny-random\nengine:\n  num_kv_blocks: 64\n")
    config = config_for("--config", str(path), "--replicas", "4")
    assert (config.port, config.replicas, config.model, config.engine) == (9000, 4, "tiny-random", {"num_kv_blocks": 64})
    # A flag typed with its default value still wins over the file.
    assert config_for("--config", str(path), "--port", "8000").port == 8000


def test_defaults_without_a_file():
    config = config_for()
    assert (config.model, config.port, config.gateways, config.replicas, config.redis) == ("default", 8000, 1, None, False)


@pytest.mark.parametrize("text, message", [
    ("replicaz: 2\n", "unknown key"),
    ("engine:\n  port: 9\n", "set by kvgate up"),
    ("port: eighty\n", "port must be a number"),
    ("policy: fastest\n", "unknown policy"),
    ("- a list\n", "mapping"),
    ("engine:\n  num_kv_blockz: 64\n", "engine: unknown setting 'num_kv_blockz'; known: .*num_kv_blocks"),
    ("engine:\n  num_kv_blocks: lots\n", "engine: num_kv_blocks: 'lots' is not an integer"),
    ("engine:\n  block_size: 3\n", "engine: block_size must be a positive power of two"),
    ("engine:\n  kv_transfer_config: {kv_timeout: 2}\n", "kv_transfer_config: unknown key.*kv_timeout_s"),
    ("engine:\n  kv_transfer_config: {kv_role: kv_consumer}\n", "engine.kv_role` is set by kvgate up"),
    ("engine:\n  num_speculative_tokens: 3\n", "top-level key `speculative_config`"),
    ("speculative_config: {method: magic}\n", "speculative_config: method: 'magic' is not one of"),
    ("engine: [1]\n", "`engine:` must be a mapping"),
    ("engine:\n  served_model_name: x\n", "served_model_name has no flag of its own; .*--served-model-name"),
    ("engine:\n  seed: null\n", "engine: seed: null is not a value here"),
    ("enforce_eager: sometimes\n", "enforce_eager must be true or false"),
    ("engine:\n  enforce_eager: true\n", "top-level key `enforce_eager`"),
])
def test_bad_config_files_are_refused_with_the_key_named(tmp_path, text: str, message: str):
    path = tmp_path / "up.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        config_for("--config", str(path))


def test_the_old_policy_name_reaches_the_gateway_as_the_new_one(tmp_path):
    path = tmp_path / "up.yaml"
    path.write_text("policy: kvgate\n")
    plan = build_plan(config_for("--config", str(path)), gpus=0, cores=2)
    assert argv_value(plan.gateways[0].argv, "--policy") == "prefix_cost"


def test_cpu_plan_splits_cores_and_puts_replicas_after_the_gateway():
    plan = build_plan(UpConfig(port=8000), gpus=0, cores=2)
    assert plan.device == "cpu" and plan.redis is None and len(plan.replicas) == 2
    assert [r.port for r in plan.replicas] == [8001, 8002] and plan.gateways[0].port == 8000
    for replica in plan.replicas:
        assert argv_value(replica.argv, "--num-threads") == "1" and replica.env["OMP_NUM_THREADS"] == "1"
    gw = plan.gateways[0].argv
    assert [gw[i + 1] for i, a in enumerate(gw) if a == "--replica"] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert "--redis-url" not in gw


def test_two_gateways_share_a_local_redis():
    plan = build_plan(UpConfig(port=7000, gateways=2, replicas=3), gpus=0, cores=16, redis_port=6400)
    assert plan.redis is not None and plan.redis_url == "redis://127.0.0.1:6400/0"
    assert [g.port for g in plan.gateways] == [7000, 7001] and [r.port for r in plan.replicas] == [7002, 7003, 7004]
    assert all(argv_value(g.argv, "--redis-url") == plan.redis_url for g in plan.gateways)
    assert argv_value(plan.replicas[0].argv, "--num-threads") == "5"  # 16 cores // 3


def test_gpus_get_one_replica_each_pinned_by_cuda_visible_devices():
    plan = build_plan(UpConfig(), gpus=3, cores=32)
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in plan.replicas] == ["0", "1", "2"]
    assert all(argv_value(r.argv, "--device") == "cuda" and "--num-threads" not in r.argv for r in plan.replicas)


def test_engine_settings_reach_the_replicas_as_the_engine_parses_them():
    config = UpConfig(engine={"num_kv_blocks": 64, "enable_prefix_caching": False,
                              "max_queue_delay_s": None, "engine_options": {"compiled": "off"},
                              "kv_transfer_config": {"kv_timeout_s": 2}},
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                      quantization="int8", model="tiny-random", shutdown_grace_s=10)
    engine, server = replica_config(build_plan(config, gpus=0, cores=2).replicas[0].argv)
    assert (engine.model, engine.quantization, engine.num_kv_blocks) == ("tiny-random", "int8", 64)
    assert engine.enable_prefix_caching is False and engine.max_queue_delay_s is None
    assert engine.engine_options == {"compiled": "off"} and engine.kv_transfer_timeout_s == 2.0
    assert (engine.speculative_method, engine.num_speculative_tokens) == ("ngram", 3)
    assert (engine.num_threads, engine.device, server.port) == (1, "cpu", 8001)
    assert server.drain_grace_s < config.shutdown_grace_s


def test_enforce_eager_reaches_every_replica_from_the_flag_or_the_file(tmp_path):
    path = tmp_path / "up.yaml"
    path.write_text("enforce_eager: true\n")
    for config in (config_for("--enforce-eager", "--model", "tiny-random"), config_for("--config", str(path))):
        engines = [replica_config(r.argv)[0] for r in build_plan(config, gpus=0, cores=2).replicas]
        assert [e.enforce_eager for e in engines] == [True, True]
    assert config_for().enforce_eager is False


def test_replicas_keep_the_engine_defaults_they_are_not_given():
    engine, server = replica_config(build_plan(UpConfig(), gpus=0, cores=2).replicas[0].argv)
    ours = {"num_threads": 1, "device": "cpu"}  # the plan's own; every other field the default
    for f in dataclasses.fields(EngineConfig):
        expected = ours.get(f.name, getattr(EngineConfig(), f.name))
        assert getattr(engine, f.name) == expected, f.name


def test_engine_keys_may_use_the_flags_spelling_and_options_come_from_the_file(tmp_path):
    path = tmp_path / "up.yaml"
    path.write_text("engine:\n  num-kv-blocks: '64'\n  engine_options: {decode: kernel}\n"
                    "  drain_grace_s: 5\n")
    engine, server = replica_config(build_plan(config_for("--config", str(path)), gpus=0,
                                               cores=2).replicas[0].argv)
    assert engine.num_kv_blocks == 64 and engine.engine_options == {"decode": "kernel"}
    assert server.drain_grace_s == 5.0


def test_gpu_count_comes_from_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert count_gpus() == 2
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert count_gpus() == 0


def test_restart_backoff_doubles_up_to_its_cap():
    config = UpConfig(restart_backoff_s=1.0, restart_backoff_max_s=30.0)
    assert [restart_delay(config, n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert restart_delay(config, 10_000) == 30  # no overflow after a long crash loop


def test_tensor_parallel_replicas_get_a_process_per_rank_and_their_share_of_cores_or_gpus():
    cpu = build_plan(UpConfig(replicas=2, tensor_parallel_size=2), gpus=0, cores=16)
    for replica in cpu.replicas:  # 2 replicas × 2 ranks share 16 cores
        assert argv_value(replica.argv, "--tensor-parallel-size") == "2"
        assert argv_value(replica.argv, "--num-threads") == "4" and replica.env["OMP_NUM_THREADS"] == "4"
    gpu = build_plan(UpConfig(tensor_parallel_size=2), gpus=4, cores=32)
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in gpu.replicas] == ["0,1", "2,3"]
    assert "--tensor-parallel-size" not in build_plan(UpConfig(), gpus=0, cores=2).replicas[0].argv


def test_tensor_parallel_size_is_checked_against_the_gpus_and_kept_out_of_engine_flags(tmp_path):
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 needs 4 GPUs per replica, but .* lists 2"):
        build_plan(UpConfig(tensor_parallel_size=4, device="cuda"), gpus=2, cores=8)
    with pytest.raises(ConfigError, match="at least 1"):
        UpConfig(tensor_parallel_size=0).validate()
    with pytest.raises(ConfigError, match="top-level key `tensor_parallel_size`"):
        UpConfig(engine={"tensor-parallel-size": 2}).validate()
    path = tmp_path / "up.yaml"
    path.write_text("tensor_parallel_size: '3'\n")
    assert config_for("--config", str(path)).tensor_parallel_size == 3
    assert config_for("--config", str(path), "-tp", "2").tensor_parallel_size == 2


def test_prefill_and_decode_replicas_get_roles_ports_and_a_share_of_the_cores():
    config = config_for("--prefill-replicas", "1", "--decode-replicas", "2", "--model", "tiny-random")
    plan = build_plan(config, gpus=0, cores=6)
    assert [r.name for r in plan.replicas] == ["prefill-1", "decode-1", "decode-2"]
    engines = [replica_config(r.argv)[0] for r in plan.replicas]
    assert [e.kv_role for e in engines] == ["prefill", "decode", "decode"]
    assert [r.port for r in plan.replicas] == [8001, 8002, 8003]
    # decode replicas' KV receivers come after every HTTP port, one each
    assert [e.kv_transfer_port for e in engines] == [0, 8004, 8005]
    assert [r.kv_port for r in plan.replicas] == [None, 8004, 8005]
    assert all(e.num_threads == 2 for e in engines)
    gw = plan.gateways[0].argv
    assert [gw[i + 1] for i, a in enumerate(gw) if a == "--replica"] == [r.url for r in plan.replicas]


def test_whole_request_replicas_can_run_beside_a_pair():
    plan = build_plan(config_for("--replicas", "1", "--prefill-replicas", "1", "--decode-replicas", "1"),
                      gpus=0, cores=3)
    assert [r.name for r in plan.replicas] == ["replica-1", "prefill-1", "decode-1"]
    assert "--kv-transfer-config" not in plan.replicas[0].argv


@pytest.mark.parametrize("argv, message", [
    (("--prefill-replicas", "1"), "at least one prefill and one decode"),
    (("--decode-replicas", "2",), "at least one prefill and one decode"),
    (("--prefill-replicas", "1", "--decode-replicas", "1", "--gateways", "0"), "gateways must be at least 1"),
])
def test_incomplete_pd_setups_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        config_for(*argv)


def test_pd_replicas_from_the_config_file(tmp_path):
    path = tmp_path / "up.yaml"
    path.write_text("prefill_replicas: 2\ndecode-replicas: 1\n")
    config = config_for("--config", str(path))
    assert (config.prefill_replicas, config.decode_replicas) == (2, 1)
    with pytest.raises(ConfigError, match="set by kvgate up"):
        path.write_text("engine:\n  kv_role: decode\n")
        config_for("--config", str(path))


def test_envoy_takes_the_gateways_port_and_asks_the_picker():
    import yaml

    plan = build_plan(config_for("--envoy", "--port", "7100", "--policy", "round_robin"), gpus=0, cores=2)
    picker, envoy = plan.gateways[0], plan.envoy
    assert [c.name for c in plan.children] == ["replica-1", "replica-2", "picker", "envoy"]
    assert envoy.port == 7100 and [r.port for r in plan.replicas] == [7101, 7102]
    assert picker.argv[3] == "picker" and argv_value(picker.argv, "--policy") == "round_robin"
    assert picker.port not in (7100, 7101, 7102)
    bootstrap = yaml.safe_load(argv_value(envoy.argv, "--config-yaml"))
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    grpc = clusters["kvgate_picker"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert grpc["address"]["socket_address"]["port_value"] == int(argv_value(picker.argv, "--grpc-port"))
    replicas = clusters["kvgate_picked"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in replicas] == [7101, 7102]
    assert envoy.health_url.endswith("/ready")


def test_envoy_waits_as_long_as_the_pickers_queue(tmp_path):
    import yaml

    path = tmp_path / "up.yaml"
    path.write_text("gateway:\n  max_queue_wait_s: 45\n")
    plan = build_plan(config_for("--envoy", "--config", str(path)), gpus=0, cores=2)
    assert argv_value(plan.gateways[0].argv, "--max-queue-wait-s") == "45"
    bootstrap = yaml.safe_load(argv_value(plan.envoy.argv, "--config-yaml"))
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    # a queued request's answer may come after its wait (the bootstrap adds 30 s for routing)
    assert ext_proc["typed_config"]["max_message_timeout"] == "75s"
    assert ext_proc["typed_config"]["message_timeout"] == "5s"


@pytest.mark.parametrize("argv, message", [
    (("--envoy", "--gateways", "2"), "gateways must be 1"),
    (("--envoy", "--prefill-replicas", "1", "--decode-replicas", "1"), "formed by the gateway"),
])
def test_envoy_setups_the_picker_cannot_serve_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        config_for(*argv)
