"""Stall detection through a gateway whose health checks are slower than its stall timeout (the
report's scenarios): a stream silent while its replica works through a long chunked prefill stays
on that replica; a hung replica's stream moves within stall + probe timeout + one TTFT."""

import pytest

from benchmarks.reliability.stall import hung_stream_moves, silent_stream_kept, stall_cluster
from tests.e2e.reliability.conftest import assert_passed

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def slow_cluster():
    with stall_cluster() as cluster:
        yield cluster


def test_a_silent_stream_whose_request_advances_is_not_migrated(slow_cluster):
    assert_passed(silent_stream_kept(slow_cluster))


def test_a_hung_replicas_stream_moves_after_an_unanswered_probe(slow_cluster):
    assert_passed(hung_stream_moves(slow_cluster))
