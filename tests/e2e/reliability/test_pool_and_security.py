"""A replica with a tiny KV pool under a crowd of long prompts, and a gateway with keys: its
own small clusters."""

import pytest

from benchmarks.reliability.cluster import LocalCluster
from benchmarks.reliability.pool_exhaustion import pool_exhausted, pool_spec
from benchmarks.reliability.security import secured_spec, security
from tests.e2e.reliability.conftest import assert_passed

pytestmark = pytest.mark.timeout(180)


def test_exhausted_pool_preempts_and_queues_without_changing_an_answer():
    with LocalCluster(pool_spec()) as cluster:
        result = pool_exhausted(cluster, prompts=8, rounds=2)
    assert_passed(result)
    assert result.notes["preemptions"] > 0 and result.notes["wrong_answers"] == 0


def test_keys_tenants_and_logs():
    with LocalCluster(secured_spec()) as cluster:
        result = security(cluster)
    assert_passed(result)
    assert result.notes["cached_tokens_alice_bob_carol"][1:] == [0, 0]
