"""deploy/envoy/envoy.yaml is what `python -m kvgate.launcher.envoy` writes for two local
replicas, and the real Envoy accepts it and the fail-open variant (`--mode validate`)."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from kvgate.launcher.envoy import EnvoySettings, envoy_binary, main, render
from tests.deploy.deploy_paths import DEPLOY

REPLICAS = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


def test_the_committed_bootstrap_is_the_launchers(capsys):
    main(["--picker", "127.0.0.1:9002", "--port", "10000", *(f"--replica={u}" for u in REPLICAS)])
    assert capsys.readouterr().out == (DEPLOY / "envoy" / "envoy.yaml").read_text()


@pytest.mark.parametrize("fail_open", [False, True])
def test_envoy_accepts_the_bootstrap(tmp_path, fail_open: bool):
    path = tmp_path / "envoy.yaml"
    path.write_text(render(EnvoySettings("127.0.0.1:9002", REPLICAS, failure_mode_allow=fail_open)))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_retries_go_to_the_pickers_next_endpoints():
    doc = yaml.safe_load(render(EnvoySettings("127.0.0.1:9002", REPLICAS, retries=3)))
    [picked, closed] = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    retry = picked["route"]["retry_policy"]
    assert retry["num_retries"] == 3 and retry["retriable_status_codes"] == [503]
    assert "direct_response" in closed  # fail closed: no picker answer, no replica
    cluster = next(c for c in doc["static_resources"]["clusters"] if c["name"] == "kvgate_picked")
    lb = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert lb["name"] == "envoy.load_balancing_policies.override_host"
    with pytest.raises(ValueError, match="replicas"):
        render(EnvoySettings("127.0.0.1:9002", []))
