"""The step cost model and the budget it drives: the model recovers a machine's costs from its
steps, and a scheduler under a flood of long prompts keeps every decode step inside the ITL target
while still finishing every request (Sarathi-style stall-free progress)."""

import random

import pytest

from backend_engine.block_pool import BlockPool
from backend_engine.config import EngineConfig
from backend_engine.kv_cache_manager import KVCacheManager
from backend_engine.sampling_params import SamplingParams
from backend_engine.scheduler import Scheduler
from backend_engine.sequence import Sequence
from backend_engine.step_budget import DecodeLoad, QueueDrain, StepBudget
from backend_engine.step_cost import StepCostModel, StepShape, calibration_shapes

# a CPU-like machine: 40 ms a step, 1.5 ms a prefill token, 2 ms a decode row,
# 4 us per context token read by a decode, 0.2 ms per thousand attention pairs of a chunk,
# 30 ms once for a step with any prefill (a second pass over the weights)
TRUE = (0.040, 0.0015, 0.002, 4e-6, 2e-4, 0.030)


def true_seconds(shape: StepShape, costs: tuple = TRUE) -> float:
    return sum(c * f for c, f in zip(costs, shape.features()))


def test_the_model_recovers_the_machine_costs_from_noisy_steps():
    rng = random.Random(0)
    model = StepCostModel()
    model.calibrate([(s, true_seconds(s)) for s in calibration_shapes()])
    for _ in range(400):
        shape = StepShape(rng.randrange(0, 512), rng.randrange(0, 64), rng.randrange(0, 60_000),
                          rng.randrange(0, 400_000))
        model.observe(shape, true_seconds(shape) * rng.uniform(0.97, 1.03))
    for got, want in zip(model.coef, TRUE):
        assert got == pytest.approx(want, rel=0.1, abs=2e-7)


def test_coefficients_never_go_negative():
    model = StepCostModel()
    # collinear, contradictory points would give a negative slope to plain least squares
    model.calibrate([(StepShape(prefill_tokens=n), 0.1 - n * 1e-5) for n in (10, 100, 1000)])
    assert (model.coef >= 0).all()
    assert model.predict(StepShape(prefill_tokens=5000)) >= 0


def test_a_chunk_sized_for_the_time_left_fits_it():
    model = StepCostModel()
    model.calibrate([(s, true_seconds(s)) for s in calibration_shapes()])
    budget = StepBudget(model, 0.2, 32, 4096)
    for cached in (0, 500, 3000):
        seconds = budget.prefill_seconds(DecodeLoad(rows=10, context_tokens=5000))
        n = budget.chunk_tokens(seconds, cached)
        assert 0 < n < 4096
        assert budget.chunk_seconds(n, cached) <= seconds * 1.001
        assert budget.chunk_seconds(n + 2, cached) > seconds


def test_the_fixed_prefill_cost_is_paid_once_a_step_not_per_token():
    # a machine whose prefill steps pay 100 ms once (weights dequantised for the prompt rows)
    costs = (0.040, 0.0015, 0.002, 4e-6, 2e-4, 0.100)
    model = StepCostModel()
    model.calibrate([(s, sum(c * f for c, f in zip(costs, s.features())))
                     for s in calibration_shapes()])
    assert model.prefill_pass_s == pytest.approx(0.100, rel=0.01)
    assert model.per_prefill_token_s == pytest.approx(0.0015, rel=0.01)
    budget = StepBudget(model, 0.25, 32, 4096)
    seconds = budget.prefill_seconds(DecodeLoad())
    assert seconds == pytest.approx(0.25 - 0.040 - 0.100, rel=0.01)
    n = budget.chunk_tokens(seconds, 0)
    full_step = model.predict(StepShape(prefill_tokens=n, attention_pairs=n * n))
    assert full_step == pytest.approx(0.25, rel=0.01)  # the chunk fills the target, no more


def _run(budget: StepBudget | None, prompts: list[int], max_tokens: int, max_steps: int = 5000,
         costs: tuple = TRUE, tile_rows: int = 1):
    """Simulated steps; tile_rows: the machine computes a step's prompt rows in tiles of this
    many rows (a partial tile costs a whole one)."""
    config = EngineConfig(enforce_eager=True, model="tiny-random", max_num_seqs=256, max_num_batched_tokens=2048)
    pool = BlockPool(4096, enable_caching=False)
    scheduler = Scheduler(config, KVCacheManager(pool, 16), budget)
    params = SamplingParams(max_tokens=max_tokens)
    for i, n in enumerate(prompts):
        scheduler.add(Sequence(f"s{i}", f"r{i}", 0, [1] * n, params, "ns", max_tokens))
    steps = []
    for _ in range(max_steps):
        out = scheduler.schedule()
        if not out:
            break
        shape = StepShape()
        prefill = rows = context = pairs = 0
        for seq, n in out.scheduled:
            if seq.num_tokens - seq.num_computed_tokens > 1:
                prefill += n
                pairs += n * (seq.num_computed_tokens + n)
            else:
                rows += 1
                context += seq.num_tokens
        shape = StepShape(prefill, rows, context, pairs)
        padded = StepShape(-(-prefill // tile_rows) * tile_rows, rows, context, pairs)
        seconds = true_seconds(padded, costs)
        if budget is not None:
            budget.model.observe(shape, seconds)
        steps.append((shape, seconds))
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens >= seq.num_tokens:
                seq.append_token(2)
                if seq.num_output_tokens >= max_tokens:
                    scheduler.finish(seq, "length")
        scheduler.sweep_finished()
    assert not scheduler.has_unfinished(), "every request finishes"
    return steps


def test_the_budget_keeps_simulated_decode_steps_under_the_target():
    rng = random.Random(1)
    prompts = [rng.randrange(200, 2000) for _ in range(120)]  # a burst of long prompts
    model = StepCostModel()
    model.calibrate([(s, true_seconds(s)) for s in calibration_shapes()])
    target = 0.25
    budget = StepBudget(model, target, min_prefill_tokens=32, max_prefill_tokens=2048)
    steps = _run(budget, prompts, max_tokens=64)
    floor = true_seconds(StepShape(prefill_tokens=32, attention_pairs=32 * 2000)) - TRUE[0]
    decoding = [(s, t) for s, t in steps if s.decode_rows]
    assert decoding
    over = [t for s, t in decoding if t > target * 1.02]
    # a step may exceed the target only by the guaranteed minimum of prefill
    assert all(t <= target + floor for _, t in decoding)
    assert len(over) <= 0.05 * len(decoding)
    # and without a budget the same burst makes steps of seconds
    fixed = _run(None, prompts, max_tokens=64)
    assert max(t for s, t in fixed if s.decode_rows) > 2 * target


# int4 on CPU: a prefill step dequantises every weight once, 110 ms
COSTLY_PASS = (0.040, 0.0015, 0.002, 4e-6, 2e-4, 0.110)


def _calibrated(costs: tuple) -> StepCostModel:
    model = StepCostModel()
    model.calibrate([(s, true_seconds(s, costs)) for s in calibration_shapes()])
    return model


class _MinFloorBudget(StepBudget):
    floor_tokens = property(lambda self: self.min_prefill_tokens)  # the floor before


def test_the_prefill_floor_amortises_a_large_fixed_prefill_cost():
    budget = StepBudget(_calibrated(COSTLY_PASS), 0.25, 32, 4096)
    assert budget.floor_tokens == 74  # 110 ms / 1.5 ms a token, rounded up
    assert StepBudget(_calibrated(COSTLY_PASS), 0.25, 128, 4096).floor_tokens == 128
    assert StepBudget(_calibrated(COSTLY_PASS), 0.25, 32, 64).floor_tokens == 64
    assert StepBudget(_calibrated(TRUE), 0.25, 32, 4096).floor_tokens == 32  # 20 < 32
    # a burst under decode load: the amortised floor retires the same work in less time than a
    # floor of 32 tokens that pays 110 ms for each, and a decode step exceeds the target by no
    # more than the fixed cost and a floor chunk (after 2,000 tokens of context) together
    rng = random.Random(2)
    prompts = [rng.randrange(200, 2000) for _ in range(120)]
    runs = {}
    for floor in ("amortised", "min"):
        kind = StepBudget if floor == "amortised" else _MinFloorBudget
        budget = kind(_calibrated(COSTLY_PASS), 0.25, 32, 2048)
        steps = _run(budget, prompts, max_tokens=64, costs=COSTLY_PASS)
        runs[floor] = sum(t for _, t in steps)
        if floor == "amortised":
            worst = 0.25 + true_seconds(StepShape(prefill_tokens=74, attention_pairs=74 * 2000),
                                        COSTLY_PASS) - COSTLY_PASS[0]
            assert all(t <= worst for s, t in steps if s.decode_rows)
    assert runs["amortised"] < 0.9 * runs["min"]  # measured 0.80


def test_a_step_s_prefill_fills_whole_tiles():
    """Where prompt rows are computed in 64-row tiles, a floor step's 32 tokens cost what 64 do:
    with the granule, every step's prefill is whole tiles (but a prompt's last chunk), and a
    burst under decode load finishes sooner."""
    budget = StepBudget(_calibrated(TRUE), 0.25, 32, 4096, granule=64)
    assert budget.floor_tokens == 64
    assert [budget.whole_granules(n) for n in (1, 64, 65)] == [64, 64, 128]
    assert StepBudget(_calibrated(TRUE), 0.25, 32, 100, granule=64).whole_granules(90) == 100
    rng = random.Random(3)
    prompts = [rng.randrange(200, 2000) for _ in range(60)]
    runs = {}
    for granule in (1, 64):
        budget = StepBudget(_calibrated(TRUE), 0.25, 32, 2048, granule=granule)
        steps = _run(budget, prompts, max_tokens=64, tile_rows=64)
        runs[granule] = sum(t for _, t in steps)
        if granule == 64:
            partial = [s for s, _ in steps if s.prefill_tokens % 64]
            assert len(partial) <= len(prompts)  # only where a prompt ends inside a tile
    assert runs[64] < 0.9 * runs[1]  # measured 0.68


def test_queue_drain_rate_follows_busy_steps_only():
    drain = QueueDrain(half_life_s=1.0)
    drain.observe(500, 1.0, queue_waiting=False)
    assert drain.rate is None
    drain.observe(100, 0.5, queue_waiting=True)
    assert drain.rate == pytest.approx(200)
    for _ in range(20):
        drain.observe(0, 0.5, queue_waiting=True)  # nothing prefilled while requests wait
    assert drain.rate < 1


def test_a_queue_rate_is_forgotten_when_the_queue_empties():
    """A rate measured while the batch was full (~0: the waiting request admitted by no step)
    must not outlive its queue: kept, it refused every request but on an idle replica."""
    drain = QueueDrain(half_life_s=1.0)
    for _ in range(20):
        drain.observe(0, 0.5, queue_waiting=True)
    assert drain.rate < 1
    drain.observe(0, 0.2, queue_waiting=False)  # the last waiting request was admitted
    assert drain.rate is None
    # the next queue starts from the prior (the step budget's estimate), not its first step
    drain.observe(0, 0.1, queue_waiting=True, prior=lambda: 150.0)
    assert drain.rate == pytest.approx(150.0 * 0.5 ** 0.1)
    drain.observe(50, 0.5, queue_waiting=False)
    drain.observe(40, 0.5, queue_waiting=True, prior=lambda: float("inf"))  # no budget
    assert drain.rate == pytest.approx(80)
