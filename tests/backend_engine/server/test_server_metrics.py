"""/metrics: Prometheus text, `kvgate_` names in base units, values that move with traffic."""

import re

from tests.backend_engine.server.conftest import MODEL


def scrape(http) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metric_names_follow_conventions(http, client):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    names = {re.sub(r"\{.*", "", n) for n in scrape(http)}
    for required in (
        "kvgate_prefix_cache_queries_tokens_total", "kvgate_prefix_cache_hits_tokens_total",
        "kvgate_time_to_first_token_seconds_bucket", "kvgate_time_per_output_token_seconds_bucket",
        "kvgate_e2e_request_latency_seconds_count", "kvgate_num_requests_running", "kvgate_num_requests_waiting",
        "kvgate_kv_cache_usage_ratio", "kvgate_num_preemptions_total", "kvgate_generation_tokens_total",
        "kvgate_request_success_total", "kvgate_http_requests_total",
    ):
        assert required in names, required
    assert all(n.startswith("kvgate_") for n in names)


def test_metrics_move_with_traffic(http, client):
    before = scrape(http)
    prompt = "The same prefix, long enough to fill two blocks of the cache. " * 3
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True})
    after = scrape(http)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kvgate_generation_tokens_total") >= 6
    assert delta("kvgate_prefix_cache_hits_tokens_total") >= 16  # the second request hit the first's blocks
    assert delta("kvgate_prefix_cache_queries_tokens_total") >= delta("kvgate_prefix_cache_hits_tokens_total")
    assert delta("kvgate_time_to_first_token_seconds_count") >= 2
    assert delta("kvgate_e2e_request_latency_seconds_count") >= 2
    assert delta('kvgate_request_success_total{finished_reason="length"}') >= 2
    assert delta('kvgate_http_requests_total{route="/v1/completions",status_code="200"}') == 2
    assert 0.0 <= after["kvgate_kv_cache_usage_ratio"] <= 1.0
