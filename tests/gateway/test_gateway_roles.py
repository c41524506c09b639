"""Replica roles at the gateway, without processes: which replicas take whole requests, when a
fleet has prefill/decode pairs, how the two halves' bodies are built, and the P/D config."""

from __future__ import annotations

import json

import pytest

from gateway.circuit import CircuitBreaker
from gateway.config import ConfigError, GatewayConfig, validate
from gateway.disagg import _decode_body, _prefill_body
from gateway.replicas import HEALTHY, Replica, role_exclusions


def replica(name: str, role: str, healthy: bool = True) -> Replica:
    r = Replica(name, f"http://{name}", CircuitBreaker(3, 5.0), models=["m"], role=role)
    r.health = HEALTHY if healthy else "down"
    return r


def test_whole_requests_prefer_both_then_decode_then_prefill_replicas():
    p, d, b = replica("p", "prefill"), replica("d", "decode"), replica("b", "both")
    assert role_exclusions([p, d, b], "m") == {"p", "d"}
    assert role_exclusions([p, d], "m") == {"p"}
    assert role_exclusions([p], "m") == set()
    # with the `both` replica down (or failed for this request) the decode replica takes it
    assert role_exclusions([p, d, replica("b", "both", healthy=False)], "m") == {"p"}
    assert role_exclusions([p, d, b], "m", tried={"b"}) == {"p"}
    assert role_exclusions([replica("x", "both"), replica("y", "both")], "m") == set()


def test_the_prefill_half_is_never_streamed_and_names_the_decode_replica():
    raw = json.dumps({"model": "m", "stream": True, "stream_options": {"include_usage": True},
                      "messages": []}).encode()
    body = json.loads(_prefill_body(raw, "t1", "tcp://10.0.0.2:8200", 3))
    assert body["stream"] is False and "stream_options" not in body
    assert body["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": "t1",
                                          "remote_address": "tcp://10.0.0.2:8200",
                                          "remote_cached_blocks": 3}


def test_the_decode_half_keeps_the_clients_request_and_adds_the_first_tokens():
    raw = json.dumps({"model": "m", "stream": True, "stream_options": {"include_usage": True}}).encode()
    answer = {"transfer_id": "t1", "first_tokens": [{"token_id": 7}], "cached_tokens": 32,
              "transfer": {"bytes": 10}}
    body = json.loads(_decode_body(raw, answer))
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["kv_transfer_params"] == {"do_remote_prefill": True, "transfer_id": "t1",
                                          "first_tokens": [{"token_id": 7}], "cached_tokens": 32}


def test_negative_pd_settings_are_refused():
    with pytest.raises(ConfigError, match="pd_bypass_tokens"):
        validate(GatewayConfig(pd_bypass_tokens=-1))
