"""LoadTracker: reserve / first token / finish, reconciled with engine reports."""

from routing.load import LoadTracker


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tracker():
    clock = FakeClock()
    t = LoadTracker(engine_stale_after_s=5.0, clock=clock)
    t.add_replica("a")
    return t, clock


def test_reserve_first_token_finish_lifecycle():
    t, _ = tracker()
    t.reserve("q1", "a", 1000)
    t.reserve("q2", "a", 200)
    assert (t.view("a").in_flight, t.view("a").pending_prefill_tokens) == (2, 1200)
    t.first_token("q1")
    assert (t.view("a").in_flight, t.view("a").pending_prefill_tokens) == (2, 200)
    t.finish("q1")
    t.finish("q2")  # finished before its first token (abort): its prefill is released too
    assert (t.view("a").in_flight, t.view("a").pending_prefill_tokens) == (0, 0)


def test_finish_of_unknown_or_repeated_request_is_harmless():
    t, _ = tracker()
    t.reserve("q1", "a", 10)
    t.finish("q1")
    t.finish("q1")
    t.finish("never-booked")
    assert t.view("a").in_flight == 0


def test_engine_report_adds_other_gateways_load():
    t, clock = tracker()
    t.reserve("q1", "a", 100)
    clock.now = 1.0
    t.observe_engine("a", {"running": 6, "waiting": 2, "kv_usage": 0.5,
                           "pending_prefill_tokens": 3000})
    view = t.view("a")
    assert (view.in_flight, view.pending_prefill_tokens, view.waiting, view.kv_usage) == (
        8, 3000, 2, 0.5)


def test_bookings_after_the_engine_report_are_added_on_top():
    t, clock = tracker()
    t.observe_engine("a", {"running": 4, "waiting": 0, "pending_prefill_tokens": 0})
    clock.now = 0.5
    t.reserve("q1", "a", 700)
    view = t.view("a")
    assert (view.in_flight, view.pending_prefill_tokens) == (5, 700)


def test_stale_engine_report_is_ignored():
    t, clock = tracker()
    t.observe_engine("a", {"running": 50, "waiting": 10})
    clock.now = 6.0
    assert t.view("a").in_flight == 0


def test_admission_bound_is_predicted_from_the_engines_estimate_and_newer_bookings():
    t, clock = tracker()
    report = {"running": 1, "waiting": 0, "pending_prefill_tokens": 0, "queue_delay_s": 1.0,
              "max_queue_delay_s": 2.0, "drain_rate_tok_s": 100.0}
    t.observe_engine("a", report)
    assert t.over_admission_bound("a", 50) is None  # 1 s + 50 tokens at 100/s = 1.5 s: admitted
    over = t.over_admission_bound("a", 150)  # 2.5 s: over the bound by 0.5 s
    assert over is not None and abs(over - 0.5) < 1e-9
    clock.now = 1.0
    t.reserve("q1", "a", 100)  # booked after the report: its prefill counts too
    assert abs(t.over_admission_bound("a", 50) - 0.5) < 1e-9
    assert t.over_admission_bound("a", 50, request_id="q1") is None  # but not for itself
    t.finish("q1")
    t.observe_engine("a", {**report, "running": 0, "queue_delay_s": 0.0})
    assert t.over_admission_bound("a", 10_000) is None  # an idle replica takes anything
    t.observe_engine("a", {**report, "max_queue_delay_s": 0})
    assert t.over_admission_bound("a", 10_000) is None  # a replica that never refuses
    t.observe_engine("a", report)
    clock.now = 10.0
    assert t.over_admission_bound("a", 10_000) is None  # a stale report predicts nothing
