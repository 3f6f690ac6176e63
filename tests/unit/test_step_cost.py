"""Step cost model: the online fit on synthetic timings (noise, spikes, a change of speed), the
non-negative solution, chunk sizing and the per-step prefill budget. Time is data; no clock."""

from __future__ import annotations

import math
import random

import pytest

from conveyor.core.plan import ScheduledRow
from conveyor.core.step_cost import (DEFAULT_PRIOR, PrefillBudget, StepCost, StepCostModel, StepShape,
                                     context_tokens)


def random_shape(rng: random.Random) -> StepShape:
    """Decode-only steps (1-64 rows at contexts 50-400) and mixed steps with a prompt chunk."""
    num_decodes = rng.randint(1, 64)
    decode_context = sum(rng.randint(50, 400) for _ in range(num_decodes))
    if rng.random() < 0.3:
        chunk, start = rng.randint(16, 512), rng.randint(0, 300)
        num_decodes = rng.randint(0, 32)
        decode_context = sum(rng.randint(50, 400) for _ in range(num_decodes))
        return StepShape(num_decodes + chunk, decode_context + context_tokens(start, chunk), chunk, num_decodes)
    return StepShape(num_decodes, decode_context, 0, num_decodes)


def feed(model: StepCostModel, truth: StepCost, num_steps: int, rng: random.Random, noise: float = 0.1,
         spike_rate: float = 0.05) -> None:
    """Steps timed as `truth` says, with gaussian noise and rare 3-10x stalls (another process, a GC)."""
    for _ in range(num_steps):
        shape = random_shape(rng)
        time_s = truth.predict_s(shape.num_tokens, shape.num_context_tokens, shape.num_sampling_rows) \
            * (1 + rng.gauss(0, noise))
        if rng.random() < spike_rate:
            time_s *= rng.uniform(3, 10)
        model.observe(shape, time_s)


def relative_errors(cost: StepCost, truth: StepCost, seed: int = 99) -> list[float]:
    rng = random.Random(seed)
    shapes = [random_shape(rng) for _ in range(300)]
    return sorted(abs(cost.predict_s(s.num_tokens, s.num_context_tokens, s.num_sampling_rows)
                      / truth.predict_s(s.num_tokens, s.num_context_tokens, s.num_sampling_rows) - 1) for s in shapes)


def test_context_tokens_of_a_decode_is_its_context_length_and_of_a_chunk_its_attention_pairs() -> None:
    assert context_tokens(start_position=99, num_tokens=1) == 100
    assert context_tokens(start_position=0, num_tokens=4) == 1 + 2 + 3 + 4
    assert context_tokens(start_position=10, num_tokens=3) == 11 + 12 + 13
    rows = (ScheduledRow("d", [5], 99, [0], is_sampling=True, is_prefill=False),
            ScheduledRow("p", [1, 2, 3], 10, [1], is_sampling=False, is_prefill=True))
    assert StepShape.from_rows(rows) == StepShape(num_tokens=4, num_context_tokens=100 + 36, num_prefill_tokens=3,
                                                  num_sampling_rows=1)


def test_with_no_steps_the_cost_is_the_prior() -> None:
    assert StepCostModel().cost == DEFAULT_PRIOR


@pytest.mark.parametrize("truth", [
    StepCost(fixed_s=0.03, per_token_s=0.0015, per_context_token_s=3e-7),     # near the prior
    StepCost(fixed_s=0.1, per_token_s=0.01, per_context_token_s=1e-6),        # 5x slower
    StepCost(fixed_s=0.002, per_token_s=0.0001, per_context_token_s=1e-8),    # 20x faster
    StepCost(fixed_s=0.005, per_token_s=0.004, per_context_token_s=0.0),      # another split of the parts
], ids=["near-prior", "slower", "faster", "other-split"])
def test_fit_converges_on_noisy_timings_with_stalls(truth: StepCost) -> None:
    model = StepCostModel()
    before = relative_errors(model.cost, truth)
    feed(model, truth, 200, random.Random(0))
    errors = relative_errors(model.cost, truth)
    assert errors[len(errors) // 2] < 0.05 and errors[int(0.95 * len(errors))] < 0.15, errors[-10:]
    if truth.fixed_s != 0.03:
        assert errors[len(errors) // 2] < before[len(before) // 2] / 4


def test_a_lasting_change_of_speed_is_followed() -> None:
    rng = random.Random(1)
    model = StepCostModel()
    fast = StepCost(0.02, 0.002, 1e-7)
    slow = StepCost(0.04, 0.004, 2e-7)   # the cores are now shared with another process
    feed(model, fast, 200, rng)
    assert relative_errors(model.cost, fast)[150] < 0.05
    feed(model, slow, 100, rng)
    assert relative_errors(model.cost, slow)[150] < 0.05


def test_one_huge_stall_does_not_move_the_fit() -> None:
    rng = random.Random(2)
    truth = StepCost(0.02, 0.002, 1e-7)
    model = StepCostModel()
    feed(model, truth, 100, rng, spike_rate=0.0)
    model.observe(StepShape(8, 2000, 0), 30.0)
    assert relative_errors(model.cost, truth)[150] < 0.03


def test_coefficients_stay_non_negative_and_bad_durations_are_ignored() -> None:
    model = StepCostModel()
    for n in range(1, 40):   # bigger steps measured faster: a least-squares slope would be negative
        model.observe(StepShape(n, n * 100, 0), 0.5 - 0.01 * n)
    cost = model.cost
    assert min(cost.fixed_s, cost.per_token_s, cost.per_context_token_s) >= 0
    num = model.num_samples
    for bad in (0.0, -1.0, math.nan, math.inf):
        model.observe(StepShape(4, 400, 0), bad)
    model.observe(StepShape(0, 0, 0), 0.1)
    assert model.num_samples == num and model.cost == cost


def test_max_chunk_is_the_largest_that_fits() -> None:
    cost = StepCost(fixed_s=0.01, per_token_s=0.001, per_context_token_s=1e-6)
    for start, time_s in [(0, 0.05), (300, 0.05), (1000, 0.2), (0, 1e-4)]:
        n = cost.max_chunk(start, time_s)
        assert cost.chunk_s(start, n) <= time_s < cost.chunk_s(start, n + 1)
    assert cost.max_chunk(1000, 0.05) < cost.max_chunk(0, 0.05)   # a deeper chunk attends to more
    assert cost.max_chunk(0, 0.0) == 0 and cost.max_chunk(0, -1.0) == 0
    assert StepCost(0.01, 0.002, 0.0).max_chunk(0, 0.05) == 25
    assert StepCost(0.01, 0.0, 0.0).max_chunk(0, 0.05) is None   # free tokens: no limit from time


def test_prefill_budget_without_decodes_or_target_is_unlimited() -> None:
    cost = StepCost(0.01, 0.001, 0.0)
    for budget in (PrefillBudget(), PrefillBudget(cost, 0.05, 8, StepShape(0, 0)),
                   PrefillBudget(cost, None, 8, StepShape(4, 400))):
        assert not budget.is_limited
        assert budget.take(0, 512) == 512 and budget.take(100, 512) == 512


def test_prefill_budget_splits_the_time_left_after_decodes_and_keeps_a_floor() -> None:
    cost = StepCost(fixed_s=0.01, per_token_s=0.001, per_context_token_s=0.0)
    decodes = StepShape(num_tokens=4, num_context_tokens=400)   # predicted 14 ms
    budget = PrefillBudget(cost, target_s=0.05, min_tokens=8, decodes=decodes)
    assert budget.take(0, 20) == 20          # 36 ms left: 20 fit
    assert budget.take(0, 100) == 16         # 16 ms left
    assert budget.take(0, 100) == 0          # nothing left and the floor is spent
    tight = PrefillBudget(cost, target_s=0.012, min_tokens=8, decodes=decodes)   # decodes alone miss it
    assert tight.take(0, 5) == 5 and tight.take(0, 100) == 3 and tight.take(0, 100) == 0
    assert PrefillBudget(cost, 0.012, 0, decodes).take(0, 100) == 0


def test_a_sampled_row_is_priced_apart_from_a_prompt_token() -> None:
    """Decode rows also run the output layer: the fit keeps that out of a prompt token's price, so
    prompt chunks are sized from what they cost."""
    truth = StepCost(fixed_s=0.01, per_token_s=0.001, per_context_token_s=1e-7, per_sampling_row_s=0.0008)
    model = StepCostModel()
    feed(model, truth, 400, random.Random(5), noise=0.05, spike_rate=0.0)
    cost = model.cost
    assert cost.per_token_s == pytest.approx(truth.per_token_s, rel=0.15)
    assert cost.per_sampling_row_s == pytest.approx(truth.per_sampling_row_s, rel=0.3)
    assert cost.chunk_s(0, 100) == pytest.approx(truth.chunk_s(0, 100), rel=0.15)
