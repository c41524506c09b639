"""Prefill/decode roles in the deploy files: the compose override and the Kubernetes overlay
validate, decode replicas advertise a KV address on a port they expose, and gateways list every
prefill and decode pod."""

from __future__ import annotations

import json
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from kvgate.cli import build_parser, engine_config_from_args
from tests.deploy.deploy_paths import DEPLOY, load_yaml_documents
from tests.deploy.test_compose_file import check_compose_schema, compose
from tests.deploy.test_k8s_manifests import CRD_KINDS, K8S_VERSIONS, selects

OVERLAY = DEPLOY / "k8s-pd"


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _kv_transfer(argv: list[str]) -> dict:
    return json.loads(_flag(argv, "--kv-transfer-config"))


def test_compose_override_validates_and_pairs_replica_1_with_replica_2():
    result = check_compose_schema(DEPLOY / "compose.pd.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    override = yaml.safe_load((DEPLOY / "compose.pd.yaml").read_text())["services"]
    prefill, decode = override["replica-1"]["command"], override["replica-2"]["command"]
    assert _kv_transfer(prefill) == {"kv_role": "kv_producer"}
    kv = _kv_transfer(decode)
    assert kv["kv_role"] == "kv_consumer" and kv["kv_address"] == f"tcp://replica-2:{kv['kv_port']}"
    base = compose()["services"]
    for name in ("replica-1", "replica-2"):  # the base's command, plus the role's flags
        assert override[name]["command"][:len(base[name]["command"])] == base[name]["command"]


def _objects(name: str) -> list[dict]:
    return load_yaml_documents(OVERLAY / name)


def _statefulset(role: str) -> dict:
    return next(o for o in _objects(f"{role}.yaml") if o["kind"] == "StatefulSet")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_overlay_objects_validate_strictly(version: str):
    for name in ("prefill.yaml", "decode.yaml"):
        for obj in _objects(name):
            kubernetes_validate.validate(obj, version, strict=True)


def test_decode_pods_advertise_their_own_ip_on_the_port_they_expose():
    sts = _statefulset("decode")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    config = engine_config_from_args(build_parser().parse_args(container["args"]))  # as it starts
    port = config.kv_transfer_port
    assert (config.kv_role, config.kv_transfer_host) == ("decode", "0.0.0.0")
    assert config.kv_transfer_address == f"tcp://$(POD_IP):{port}"
    assert {"name": "kv-transfer", "containerPort": port} in container["ports"]
    pod_ip = next(e for e in container["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    service = next(o for o in _objects("decode.yaml") if o["kind"] == "Service")
    assert {"name": "kv-transfer", "port": port, "targetPort": "kv-transfer"} in service["spec"]["ports"]
    assert selects({"matchLabels": service["spec"]["selector"]}, sts["spec"]["template"]["metadata"]["labels"])
    prefill = _statefulset("prefill")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert engine_config_from_args(build_parser().parse_args(prefill)).kv_role == "prefill"


def test_gateway_config_lists_every_prefill_and_decode_pod(tmp_path):
    from gateway.config import GatewayConfig, load_file

    expected = []
    for role in ("prefill", "decode"):
        sts = _statefulset(role)
        ns, svc = sts["metadata"]["namespace"], sts["spec"]["serviceName"]
        expected += [f"http://{sts['metadata']['name']}-{i}.{svc}.{ns}.svc.cluster.local:8000"
                     for i in range(sts["spec"]["replicas"])]
    config = next(o for o in _objects("patches.yaml") if o["kind"] == "ConfigMap")
    (tmp_path / "gateway.yaml").write_text(config["data"]["gateway.yaml"])
    assert load_file(tmp_path / "gateway.yaml", GatewayConfig()).replicas == expected


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl renders the kustomization")
def test_rendered_overlay_validates_and_scrapes_every_role():
    rendered = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True,
                              timeout=60, check=True).stdout
    objects = [o for o in yaml.safe_load_all(rendered) if o]
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) not in CRD_KINDS:
            kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)
    sets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "StatefulSet"}
    assert sets["kvgate-replica"]["spec"]["replicas"] == 0
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    scraped = {s["metadata"]["name"] for s in objects
               if s["kind"] == "Service" and selects(monitor["spec"]["selector"], s["metadata"]["labels"])}
    assert {"kvgate-prefill", "kvgate-decode", "kvgate-gateway"} <= scraped
