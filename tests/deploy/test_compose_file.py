"""deploy/compose.yaml (+ the GPU override) against the compose-spec JSON schema bundled in
check-jsonschema, and nginx.conf against the services it balances."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from tests.deploy.deploy_paths import DEPLOY

COMPOSE_FILES = ("compose.yaml", "compose.gpu.yaml")


def check_compose_schema(*paths) -> subprocess.CompletedProcess:
    # The module of the interpreter running the tests: the venv's bin/ may not be on PATH.
    cmd = [sys.executable, "-m", "check_jsonschema"]
    return subprocess.run([*cmd, "--builtin-schema", "vendor.compose-spec", *map(str, paths)],
                          capture_output=True, text=True, timeout=60)


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_files_match_the_compose_spec():
    result = check_compose_schema(*(DEPLOY / name for name in COMPOSE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_rejects_an_invalid_service(tmp_path):
    bad = compose()
    bad["services"]["redis"]["retart"] = "always"  # a typo of `restart`
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(bad))
    result = check_compose_schema(tmp_path / "compose.yaml")
    assert result.returncode == 1 and "retart" in result.stdout


def test_compose_runs_redis_two_gateways_replicas_and_a_load_balancer():
    services = compose()["services"]
    gateways = sorted(n for n, s in services.items() if s.get("command", [""])[0] == "gateway")
    replicas = sorted(n for n, s in services.items() if s.get("command", [""])[0] == "engine")
    assert len(gateways) == 2 and len(replicas) >= 2 and "redis" in services and "lb" in services
    for name in gateways:
        cmd = services[name]["command"]
        urls = [cmd[i + 1] for i, flag in enumerate(cmd) if flag == "--replica"]
        assert urls == [f"http://{r}:8000" for r in replicas]  # every replica, each once
        assert cmd[cmd.index("--redis-url") + 1].startswith("redis://redis:")


@pytest.fixture(scope="module")
def nginx_conf() -> str:
    return (DEPLOY / "nginx" / "nginx.conf").read_text()


def test_nginx_balances_exactly_the_compose_gateways(nginx_conf: str):
    services = compose()["services"]
    gateways = sorted(n for n, s in services.items() if s.get("command", [""])[0] == "gateway")
    upstream = sorted(re.findall(r"^\s*server\s+([\w-]+):8000\b", nginx_conf, flags=re.M))
    assert upstream == gateways
    listen = re.search(r"^\s*listen\s+(\d+);", nginx_conf, flags=re.M).group(1)
    assert any(p.endswith(f":{listen}") for p in services["lb"]["ports"])
    assert "./nginx/nginx.conf:/etc/nginx/nginx.conf:ro" in services["lb"]["volumes"]


def test_nginx_streams_server_sent_events_unbuffered(nginx_conf: str):
    directives = {line.strip().rstrip(";") for line in nginx_conf.splitlines()}
    assert {"proxy_buffering off", "proxy_http_version 1.1", 'proxy_set_header Connection ""'} <= directives
    assert nginx_conf.count("{") == nginx_conf.count("}")
