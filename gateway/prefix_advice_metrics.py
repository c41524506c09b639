"""Prometheus series of prefix-stability advice, per (key, model): occurrences and the prefill
tokens they wasted (counted once a field is advice, so one-offs never move them), and the
saving per request of the advice active now (refreshed at scrape time)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.prefix_advice import Occurrence, PrefixAdvisor


class PrefixAdviceMetrics:
    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.instability = Counter(
            prefix + "prefix_instability_total",
            "Prompts whose cached prefix broke early on a recurring volatile field",
            ["key", "model"], registry=registry)
        self.wasted = Counter(
            prefix + "prefix_instability_wasted_tokens_total",
            "Estimated prefill tokens those prompts recomputed that moving the field to the end "
            "would have served from the prefix cache", ["key", "model"], registry=registry)
        self.saving = Gauge(
            prefix + "prefix_advice_saving_tokens",
            "Active advice: estimated prefill tokens per request that moving the field would save",
            ["key", "model"], registry=registry)

    def record(self, occurrence: Occurrence) -> None:
        if occurrence.reported:
            a = occurrence.advice
            self.instability.labels(a.key, a.model).inc(occurrence.reported)
            self.wasted.labels(a.key, a.model).inc(occurrence.reported_waste)

    def refresh(self, advisor: PrefixAdvisor | None) -> None:
        self.saving.clear()
        if advisor is not None:
            for (key, model), tokens in advisor.active_savings().items():
                self.saving.labels(key, model).set(tokens)
