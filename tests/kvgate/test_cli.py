"""`kvgate` command line: flags map onto the engine and server settings; heavy imports are lazy."""

import subprocess
import sys

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
