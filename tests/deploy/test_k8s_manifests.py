"""deploy/k8s: every object validates against the Kubernetes OpenAPI schemas (offline, strict),
and the objects fit together — selectors, named ports, probes, the gateway's replica list."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.deploy_paths import K8S, load_yaml_documents

# The oldest Kubernetes we document support for, and the newest schemas the tool bundles.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}  # no bundled schema: checked below


def applied_files() -> list[str]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]


def all_objects() -> list[dict[str, Any]]:
    return [doc for name in applied_files() for doc in load_yaml_documents(K8S / name)]


def find(kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [o for o in all_objects() if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    if len(matches) != 1:
        raise LookupError(f"expected one {kind} {name or ''}, found {len(matches)}")
    return matches[0]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Label selector semantics (matchLabels and the In operator)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        if expr["operator"] != "In":
            raise NotImplementedError(expr["operator"])
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_kustomization_applies_every_manifest_file():
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(applied_files()) == on_disk


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_builtin_object_validates_strictly(version: str):
    checked = 0
    for obj in all_objects():
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 10  # namespace, config, secret, redis ×2, replicas ×3, gateway ×4


def test_strict_validation_rejects_a_misspelt_field():
    deployment = copy.deepcopy(find("Deployment", "kvgate-gateway"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_workload_selectors_match_their_pod_templates_and_services_find_pods():
    workloads = [o for o in all_objects() if o["kind"] in ("Deployment", "StatefulSet")]
    pod_labels = [w["spec"]["template"]["metadata"]["labels"] for w in workloads]
    for w in workloads:
        assert selects(w["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"]), w["metadata"]["name"]
    for svc in (o for o in all_objects() if o["kind"] == "Service"):
        assert any(selects({"matchLabels": svc["spec"]["selector"]}, labels) for labels in pod_labels), svc["metadata"]["name"]


def test_replicas_are_a_gpu_statefulset_with_health_probes_behind_a_headless_service():
    sts = find("StatefulSet", "kvgate-replica")
    headless = find("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    port_names = {p["name"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
        assert container[probe]["httpGet"]["port"] in port_names
    drain = float(container["args"][container["args"].index("--drain-grace") + 1])
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain


def test_gateway_config_lists_every_statefulset_pod_and_loads(tmp_path):
    from gateway.config import GatewayConfig, load_file

    sts = find("StatefulSet", "kvgate-replica")
    ns, svc = sts["metadata"]["namespace"], sts["spec"]["serviceName"]
    port = sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    expected = [f"http://{sts['metadata']['name']}-{i}.{svc}.{ns}.svc.cluster.local:{port}"
                for i in range(sts["spec"]["replicas"])]
    text = find("ConfigMap", "kvgate-config")["data"]["gateway.yaml"]
    assert yaml.safe_load(text)["replicas"] == expected
    (tmp_path / "gateway.yaml").write_text(text)
    assert load_file(tmp_path / "gateway.yaml", GatewayConfig()).replicas == expected


def test_gateway_refs_exist_and_the_hpa_scales_it():
    deployment = find("Deployment", "kvgate-gateway")
    hpa = find("HorizontalPodAutoscaler", "kvgate-gateway")
    assert (hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"]) == ("Deployment", "kvgate-gateway")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "cpu" in container["resources"]["requests"]  # a CPU-utilisation HPA needs a request
    secret_keys = set(find("Secret", "kvgate-keys")["stringData"])
    config_keys = set(find("ConfigMap", "kvgate-config")["data"])
    for env in container["env"]:
        ref = env["valueFrom"]
        if "secretKeyRef" in ref:
            assert ref["secretKeyRef"]["key"] in secret_keys
        else:
            assert ref["configMapKeyRef"]["key"] in config_keys


def test_servicemonitor_scrapes_replicas_and_gateways_by_named_port():
    monitor = find("ServiceMonitor")
    services = [o for o in all_objects() if o["kind"] == "Service"]
    scraped = {s["metadata"]["name"] for s in services if selects(monitor["spec"]["selector"], s["metadata"]["labels"])}
    assert scraped == {"kvgate-replica", "kvgate-gateway"}
    for name in scraped:
        svc = next(s for s in services if s["metadata"]["name"] == name)
        assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
