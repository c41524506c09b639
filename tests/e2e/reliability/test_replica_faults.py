"""Replicas killed, hung and slow under load through two gateways: nothing is lost, only streams
already cut fail (with an OpenAI error event), traffic moves away and comes back."""

import pytest

from benchmarks.reliability.replica_faults import replica_hung, replica_killed, replica_slow
from tests.e2e.reliability.conftest import assert_passed

pytestmark = pytest.mark.timeout(180)


def test_killed_replica_fails_over_and_rejoins_with_its_index_rebuilt(cluster):
    result = replica_killed(cluster, before=8, after=16, workers=4)
    assert_passed(result)
    assert result.sent >= 24 and result.notes["marked_down_after_s"] < 5


def test_hung_replica_loses_its_waiting_requests_to_another_and_comes_back(cluster):
    result = replica_hung(cluster, before=6, after=6, pause_s=8.0)
    assert_passed(result)
    # Requests already waiting on it moved on once the checks found it down, not after the pause.
    assert result.notes["slowest_waiting_request_s"] < 6.0


def test_slow_replica_is_taken_out_and_back(cluster):
    assert_passed(replica_slow(cluster, slow_for_s=3.0))
