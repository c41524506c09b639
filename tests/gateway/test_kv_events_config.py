"""`--replica URL --kv-events SPEC`, the config file's replica entries and the spec itself."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, GatewayConfig, load_file, validate
from gateway.kv_events_spec import KvEventsSpecError, parse_kv_events
from gateway.serve import config_from_args
from kvgate.cli import build_parser


def test_spec_parses_endpoint_replay_topic_and_dp_ranks():
    spec = parse_kv_events("tcp://vllm-0:5557,replay=tcp://vllm-0:5657,topic=kv,dp_size=2")
    assert spec.ranks() == [(0, "tcp://vllm-0:5557", "tcp://vllm-0:5657"),
                            (1, "tcp://vllm-0:5558", "tcp://vllm-0:5658")]
    assert str(spec) == "tcp://vllm-0:5557,replay=tcp://vllm-0:5657,topic=kv,dp_size=2"
    assert parse_kv_events("ipc:///run/kv.sock").ranks() == [(0, "ipc:///run/kv.sock", None)]


@pytest.mark.parametrize("value", ["tcp://*:5557", "http://x:1", "tcp://host", "tcp://h:0",
                                   "tcp://h:1,replay=x", "tcp://h:1,dp_size=0", "tcp://h:1,color=red"])
def test_bad_specs_say_what_is_wrong(value):
    with pytest.raises(KvEventsSpecError, match="--kv-events"):
        parse_kv_events(value)


def test_kv_events_belongs_to_the_replica_before_it():
    args = build_parser().parse_args([
        "gateway", "--replica", "http://a:8000/", "--kv-events", "tcp://a:5557",
        "--replica", "http://b:8000"])
    config = config_from_args(args)
    assert config.kv_events == {"http://a:8000": "tcp://a:5557"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "--kv-events", "tcp://a:5557"])


def test_config_file_replica_entries_carry_kv_events(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text("replicas:\n  - http://kvgate-0:8000\n"
                    "  - {url: http://vllm-0:8000, kv_events: 'tcp://vllm-0:5557,replay=tcp://vllm-0:5558'}\n")
    config = validate(load_file(path, GatewayConfig()))
    assert config.replicas == ["http://kvgate-0:8000", "http://vllm-0:8000"]
    assert config.kv_events["http://vllm-0:8000"].startswith("tcp://vllm-0:5557")
    path.write_text("replicas:\n  - {url: http://v:8000, kv_events: 'tcp://*:5557'}\n")
    with pytest.raises(ConfigError, match="replica http://v:8000"):
        validate(load_file(path, GatewayConfig()))
    path.write_text("replicas:\n  - {url: http://v:8000, events: x}\n")
    with pytest.raises(ConfigError, match=r"replicas\[0\]"):
        load_file(path, GatewayConfig())
