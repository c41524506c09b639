"""`kvgate up` keeps keys off its children's command lines (which `ps` shows every local user):
gateways get theirs through the environment, replicas without a gateway too; the command lines
it logs are masked besides."""

import pytest

from gateway.config import GatewayConfig, apply_env
from kvgate.cli import build_parser, server_settings_from_args
from kvgate.launcher.child import redacted
from kvgate.launcher.config import UpConfig
from kvgate.launcher.plan import build_plan


def test_key_values_are_masked_in_both_spellings():
    argv = ["python", "-m", "kvgate.cli", "gateway", "--admin-key=admin-s3cret", "--api-key", "sk-s3cret",
            "--api-key=sk-two", "--port", "8000"]
    shown = " ".join(redacted(argv))
    assert "s3cret" not in shown and "sk-two" not in shown
    assert shown == ("python -m kvgate.cli gateway --admin-key=*** --api-key *** --api-key=*** --port 8000")


def test_gateways_get_their_keys_through_the_environment(monkeypatch):
    monkeypatch.setenv("KVGATE_API_KEYS", "sk-already-there")
    config = UpConfig(gateways=2, admin_key="admin-s3cret", api_key="sk-s3cret")
    plan = build_plan(config, gpus=0, cores=2)
    for child in plan.children:
        assert not any("s3cret" in arg for arg in child.argv)
    for gw in plan.gateways:
        parsed = apply_env(GatewayConfig(), gw.env)
        assert parsed.admin_key == "admin-s3cret"
        assert [k.key for k in parsed.api_keys] == ["sk-already-there", "sk-s3cret"]


@pytest.mark.parametrize("gateways", [0, 1])
def test_replicas_without_a_gateway_get_the_user_key_through_the_environment(monkeypatch, gateways):
    plan = build_plan(UpConfig(gateways=gateways, api_key="sk-s3cret"), gpus=0, cores=2)
    replica = plan.replicas[0]
    assert not any("s3cret" in arg for arg in replica.argv)
    monkeypatch.setattr("os.environ", {**replica.env})
    settings = server_settings_from_args(build_parser().parse_args(replica.argv[3:]))
    assert settings.api_key == ("sk-s3cret" if gateways == 0 else None)  # else the gateway checks it
