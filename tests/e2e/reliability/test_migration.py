"""Mid-stream migration through two gateways (the report's scenarios, fewer streams): a replica
killed among concurrent greedy streams, and a stream past the migration limit."""

import pytest

from benchmarks.reliability.migration import migration_limit, streams_migrate
from tests.e2e.reliability.conftest import assert_passed

pytestmark = pytest.mark.timeout(240)


def test_streams_of_a_killed_replica_read_the_uninterrupted_answers(cluster):
    result = streams_migrate(cluster, "kill", streams=10, seed=1)
    assert_passed(result)
    assert result.notes["streams_on_the_victim"] > 0


def test_a_stream_past_the_migration_limit_ends_with_an_error_event(cluster):
    assert_passed(migration_limit(cluster))
