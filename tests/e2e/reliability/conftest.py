"""One local cluster (2 tiny replicas, 2 gateways, Redis) for the fault scenarios of this
package; every scenario leaves it as it found it."""

from __future__ import annotations

import shutil

import pytest

from benchmarks.reliability.cluster import ClusterSpec, LocalCluster
from benchmarks.reliability.result import ScenarioResult


@pytest.fixture(scope="package")
def cluster():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (`apt-get install -y redis-server`)")
    with LocalCluster(ClusterSpec()) as c:
        yield c


def assert_passed(result: ScenarioResult) -> None:
    assert result.passed, f"{result.name}: failed checks {result.failed_checks()}, lost {result.lost}, notes {result.notes}"
