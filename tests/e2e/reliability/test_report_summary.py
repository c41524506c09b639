"""The report's last line: lost requests, scenarios passed, fuzz 5xx and the soak's RSS growth."""

from benchmarks.reliability.result import ScenarioResult
from benchmarks.reliability_report import summary, table


def test_summary_counts_what_the_scenarios_found():
    results = [ScenarioResult("soak (60 s)", 100, 100, 0, 0, {"ok": True}, rss_growth_mb={"gateway-1": 3.5, "replica-1": 12.0}),
               ScenarioResult("schema fuzzing (schemathesis)", 500, 498, 2, 0, {"no 5xx": False}),
               ScenarioResult("replica killed (SIGKILL)", 40, 37, 2, 1, {"ok": True})]
    assert summary(results) == {"requests_lost": 1, "scenarios_passed": 1, "scenarios_total": 3,
                                "fuzz_5xx": 2, "rss_growth_mb": 12.0}
    lines = table(results).splitlines()
    assert lines[2] == "| soak (60 s) | 100 | 100 | 0 | 0 | +3.5 | +12.0 | yes |"
    assert lines[3].endswith("| NO: no 5xx |")
    assert lines[4].endswith("| NO: requests lost |")  # a lost request alone fails a scenario
