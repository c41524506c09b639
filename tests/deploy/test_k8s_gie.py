"""deploy/k8s-gie: kvgate as the endpoint picker of a Gateway API Inference Extension pool. The
built-in objects validate against Kubernetes' schemas, the InferencePool and HTTPRoute against
their CRDs' schemas (committed under tests/deploy/crds, offline, unknown fields refused), and
the objects fit together: the pool selects the replica pods on their port, its picker is the
picker Service's gRPC port, the route's backend is the pool, the picker's args parse."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvgate.cli import build_parser
from tests.deploy.deploy_paths import DEPLOY, load_yaml_documents
from tests.deploy.test_k8s_manifests import K8S_VERSIONS, all_objects, find, selects

OVERLAY = DEPLOY / "k8s-gie"
CRDS = Path(__file__).with_name("crds")
SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.yaml",
           ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.yaml"}


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())


def overlay_objects() -> list[dict[str, Any]]:
    return [doc for name in kustomization()["resources"] if name.endswith(".yaml")
            for doc in load_yaml_documents(OVERLAY / name)]


def one(kind: str) -> dict[str, Any]:
    [obj] = [o for o in overlay_objects() if o["kind"] == kind]
    return obj


def strict(schema: Any) -> Any:
    """The schema refusing fields it does not name (as `kubectl apply --validate=strict`)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    doc = yaml.safe_load((CRDS / SCHEMAS[(api_version, kind)]).read_text())
    assert f"{doc['group']}/{doc['version']}" == api_version and doc["kind"] == kind
    return strict(doc["openAPIV3Schema"])


def test_kustomization_applies_the_base_and_every_overlay_file():
    on_disk = {p.name for p in OVERLAY.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization()["resources"]) == on_disk | {"../k8s"}


def test_patches_remove_the_bases_own_gateway_and_nothing_unknown():
    deleted = [d for d in (yaml.safe_load(p["patch"]) for p in kustomization()["patches"])
               if d.get("$patch") == "delete"]
    for d in deleted:  # each names an object of the base
        assert find(d["kind"], d["metadata"]["name"])["apiVersion"] == d["apiVersion"]
    assert {d["kind"] for d in deleted} >= {"Deployment", "Service", "HorizontalPodAutoscaler"}
    assert all(d["metadata"]["name"] == "kvgate-gateway" for d in deleted)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl renders the kustomization")
def test_rendered_overlay_has_the_picker_and_no_gateway():
    rendered = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True,
                              timeout=60, check=True).stdout
    objects = [o for o in yaml.safe_load_all(rendered) if o]
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Deployment", "kvgate-picker"), ("InferencePool", "kvgate"), ("HTTPRoute", "kvgate"),
            ("StatefulSet", "kvgate-replica"), ("ConfigMap", "kvgate-config")} <= names
    assert not any(name == "kvgate-gateway" for _, name in names)
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    scraped = {o["metadata"]["name"] for o in objects
               if o["kind"] == "Service" and selects(monitor["spec"]["selector"], o["metadata"]["labels"])}
    assert scraped == {"kvgate-replica", "kvgate-picker"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_objects_validate_strictly(version: str):
    builtin = [o for o in overlay_objects() if (o["apiVersion"], o["kind"]) not in SCHEMAS]
    assert {o["kind"] for o in builtin} == {"Deployment", "Service", "PodDisruptionBudget"}
    for obj in builtin:
        kubernetes_validate.validate(obj, version, strict=True)


def test_pool_and_route_validate_against_their_crd_schemas():
    for (api_version, kind) in SCHEMAS:
        jsonschema.validate(one(kind), crd_schema(api_version, kind))
    pool = copy.deepcopy(one("InferencePool"))
    pool["spec"]["targetPort"] = 8000  # a misspelt field beside the right one: refused
    with pytest.raises(jsonschema.ValidationError, match="'targetPort' was unexpected"):
        jsonschema.validate(pool, crd_schema("inference.networking.k8s.io/v1", "InferencePool"))


def test_pool_selects_the_replica_pods_and_asks_the_picker_on_its_grpc_port():
    pool = one("InferencePool")["spec"]
    replicas = find("StatefulSet", "kvgate-replica")["spec"]["template"]
    assert selects(pool["selector"], replicas["metadata"]["labels"])
    assert not any(selects(pool["selector"], o["spec"]["template"]["metadata"]["labels"])
                   for o in overlay_objects() if o["kind"] == "Deployment")
    ports = {p["containerPort"] for p in replicas["spec"]["containers"][0]["ports"]}
    assert {p["number"] for p in pool["targetPorts"]} <= ports
    picker_ref = pool["endpointPickerRef"]
    assert picker_ref.get("kind", "Service") == "Service" and "port" in picker_ref  # the CRD's CEL rule
    service = next(o for o in overlay_objects() if o["kind"] == "Service"
                   and o["metadata"]["name"] == picker_ref["name"])
    service_port = next(p for p in service["spec"]["ports"] if p["port"] == picker_ref["port"]["number"])
    assert service_port["appProtocol"] == "kubernetes.io/h2c"  # ext_proc is gRPC
    deployment = one("Deployment")
    assert selects({"matchLabels": service["spec"]["selector"]}, deployment["spec"]["template"]["metadata"]["labels"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = build_parser().parse_args(container["args"])
    assert args.command == "picker" and args.grpc_host == "0.0.0.0"
    assert named[service_port["targetPort"]] == args.grpc_port
    assert container["readinessProbe"]["httpGet"]["port"] == "http" and named["http"] == args.port


def test_route_sends_the_openai_paths_to_the_pool():
    route, pool = one("HTTPRoute"), one("InferencePool")
    [rule] = route["spec"]["rules"]
    [backend] = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
    assert route["metadata"]["namespace"] == pool["metadata"]["namespace"] == "kvgate"
    assert rule["matches"][0]["path"] == {"type": "PathPrefix", "value": "/v1"}


def test_picker_reads_the_same_config_and_keys_as_the_gateway():
    picker = one("Deployment")["spec"]["template"]["spec"]
    gateway = next(o for o in all_objects() if o["kind"] == "Deployment"
                   and o["metadata"]["name"] == "kvgate-gateway")["spec"]["template"]["spec"]
    assert picker["containers"][0]["env"] == gateway["containers"][0]["env"]
    assert picker["volumes"] == gateway["volumes"]
