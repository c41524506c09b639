"""Redis restarted, a gateway killed, clients leaving at random points: no request fails for it,
and no booking, lease or KV block outlives the request it belonged to."""

import pytest

from benchmarks.reliability.state_faults import client_disconnects, gateway_killed, redis_restarted
from tests.e2e.reliability.conftest import assert_passed

pytestmark = pytest.mark.timeout(180)


def test_redis_restart_fails_no_request_and_sharing_resumes(cluster):
    result = redis_restarted(cluster, before=10, during=10, after=10)
    assert_passed(result)
    assert result.failed == 0 and result.sent >= 30


def test_killed_gateway_leaves_no_phantom_load(cluster):
    result = gateway_killed(cluster)
    assert_passed(result)
    assert result.notes["leases_before_kill"] == 4
    assert result.notes["leases_expired_after_s"] <= cluster.spec.gateway["lease_s"] + 1


def test_clients_leaving_at_random_points_leave_nothing_behind(cluster):
    assert_passed(client_disconnects(cluster, count=24, seed=1))
