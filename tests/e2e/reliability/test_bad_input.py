"""Hand-written bad input and schema-based fuzzing (schemathesis, from each edge's OpenAPI
document) against the gateway and a replica: never a 5xx, every error in its API's format."""

import pytest

from benchmarks.reliability.bad_input import bad_input
from benchmarks.reliability.cluster import MAX_BODY_BYTES
from benchmarks.reliability.fuzz import MESSAGES_PATHS, fuzz
from tests.e2e.reliability.conftest import assert_passed

pytestmark = pytest.mark.timeout(180)


def test_hand_written_bad_input_gets_openai_errors(cluster):
    result = bad_input(cluster.gateways[0].spec.url, cluster.replicas[0].spec.url, MAX_BODY_BYTES)
    assert_passed(result)
    assert result.sent > 30


def test_schema_fuzzing_finds_no_5xx(cluster):
    result = fuzz(cluster.gateways[0].spec.url, cluster.replicas[0].spec.url, examples=12)
    assert_passed(result)
    assert result.sent > 100 and result.notes["fuzz_5xx"] == 0


def test_messages_api_fuzzing_finds_no_5xx(cluster):
    result = fuzz(cluster.gateways[0].spec.url, cluster.replicas[0].spec.url, examples=3,
                  paths=MESSAGES_PATHS)
    assert_passed(result)
    assert result.sent >= 16 and result.notes["fuzz_5xx"] == 0
