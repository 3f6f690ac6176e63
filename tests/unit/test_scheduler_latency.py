"""Stall-free scheduling under a target ITL: step order, prompt chunks cut to the cost model's
budget, decodes never starved, the full chunk when nothing decodes. Fake clock; no model."""

from __future__ import annotations

import random

from helpers import FakeClock, audit_blocks, make_request

from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.plan import StepPlan
from conveyor.core.request import RequestStatus
from conveyor.core.scheduler import Scheduler
from conveyor.core.step_cost import StepCost, StepCostModel, StepShape

TOKEN = 7
# 10 ms a step plus 1 ms a token; with no samples the model's cost is its prior, exactly.
KNOWN = StepCost(fixed_s=0.01, per_token_s=0.001, per_context_token_s=0.0)


def make_scheduler(target_itl_ms: float | None = 50.0, min_prefill_chunk: int = 4, max_num_batched_tokens: int = 256,
                   max_num_seqs: int = 16, num_blocks: int = 256, cost: StepCost | None = KNOWN,
                   cost_model: StepCostModel | None = None, long_prefill_max_slowdown: float | None = None,
                   long_prefill_token_threshold: int | None = None) -> Scheduler:
    """The long-prompt cap is off unless asked for: most tests here are about the target alone."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             target_itl_ms=target_itl_ms, min_prefill_chunk=min_prefill_chunk,
                             long_prefill_max_slowdown=long_prefill_max_slowdown,
                             long_prefill_token_threshold=long_prefill_token_threshold)
    model = cost_model or (StepCostModel(prior=cost) if cost is not None else None)
    return Scheduler(config, BlockManager(num_blocks, 4), 4096, FakeClock(), model)


def step(sched: Scheduler) -> StepPlan:
    plan = sched.schedule()
    sched.update(plan, [[TOKEN]] * len(plan.sampling_ids))
    audit_blocks(sched.blocks, list(sched.requests.values()))
    return plan


def start_decoding(sched: Scheduler, num: int, prompt_len: int = 8) -> None:
    """`num` requests past their prompt, each with one token to decode next step."""
    for i in range(num):
        sched.add(make_request(f"d{i}", prompt_len=prompt_len, max_tokens=1000, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.waiting:
        step(sched)


def test_order_is_decodes_then_started_prompts_then_new_prompts() -> None:
    sched = make_scheduler(target_itl_ms=None)
    sched.add(make_request("long", prompt_len=400, max_tokens=4))   # arrives first: highest priority
    sched.add(make_request("short", prompt_len=8, max_tokens=4))
    plan = step(sched)
    assert plan.num_scheduled_tokens == {"long": 256}
    plan = step(sched)
    assert plan.num_scheduled_tokens == {"long": 144, "short": 8}
    sched.add(make_request("late", prompt_len=300, max_tokens=4))
    sched.add(make_request("mid", prompt_len=300, max_tokens=4))
    plan = step(sched)   # long and short decode; late starts
    assert [r.request_id for r in plan.rows] == ["long", "short", "late"]
    assert plan.num_scheduled_tokens == {"long": 1, "short": 1, "late": 254}
    plan = step(sched)   # the started prompt comes before the new one, although the decodes came first
    assert [r.request_id for r in plan.rows] == ["long", "short", "late", "mid"]
    assert plan.num_scheduled_tokens == {"long": 1, "short": 1, "late": 46, "mid": 208}


def test_with_nothing_decoding_a_prompt_gets_the_largest_chunk_however_tight_the_target() -> None:
    sched = make_scheduler(target_itl_ms=1.0, max_num_batched_tokens=200)
    sched.add(make_request("a", prompt_len=500, max_tokens=2))
    assert [step(sched).num_scheduled_tokens for _ in range(3)] == [{"a": 200}, {"a": 200}, {"a": 100}]


def test_chunk_is_cut_to_what_the_target_leaves_after_the_decodes() -> None:
    sched = make_scheduler(target_itl_ms=50.0)
    start_decoding(sched, 4)
    sched.add(make_request("p", prompt_len=500, max_tokens=2))
    plan = step(sched)
    # 4 decodes: 10 + 4 ms predicted; the other 36 ms buy 36 prompt tokens.
    assert plan.num_decode_tokens == 4 and plan.num_scheduled_tokens["p"] == 36
    assert KNOWN.predict_s(40, 0) <= 0.050 < KNOWN.predict_s(41, 0)


def test_budget_shrinks_with_a_tighter_target_and_with_more_decodes() -> None:
    def first_chunk(target_itl_ms: float | None, num_decodes: int) -> int:
        sched = make_scheduler(target_itl_ms=target_itl_ms)
        start_decoding(sched, num_decodes)
        sched.add(make_request("p", prompt_len=500, max_tokens=2))
        return step(sched).num_scheduled_tokens["p"]

    by_target = [first_chunk(t, 4) for t in (None, 200.0, 100.0, 50.0, 20.0)]
    assert by_target == [256 - 4, 186, 86, 36, 6]
    by_decodes = [first_chunk(50.0, n) for n in (1, 4, 12)]
    assert by_decodes == [39, 36, 28]


def test_decodes_are_never_starved_and_prompts_still_move_at_the_floor() -> None:
    sched = make_scheduler(target_itl_ms=10.0, min_prefill_chunk=4)   # the decodes alone take 18 ms
    start_decoding(sched, 8)
    sched.add(make_request("p", prompt_len=20, max_tokens=50, ignore_eos=True))
    sched.add(make_request("q", prompt_len=20, max_tokens=50, ignore_eos=True))
    for _ in range(5):
        plan = step(sched)
        assert plan.num_decode_tokens == 8 and plan.num_prefill_tokens == 4
        assert plan.num_scheduled_tokens["p"] == 4 and "q" not in plan.num_scheduled_tokens
    plan = step(sched)   # p has its first token and decodes with the others; q takes the floor
    assert plan.num_decode_tokens == 9 and plan.num_scheduled_tokens["q"] == 4


def test_without_a_cost_model_or_a_target_the_token_budget_alone_sizes_steps() -> None:
    for sched in (make_scheduler(target_itl_ms=50.0, cost=None), make_scheduler(target_itl_ms=None)):
        start_decoding(sched, 4)
        sched.add(make_request("p", prompt_len=500, max_tokens=2))
        assert step(sched).num_scheduled_tokens["p"] == 252


def test_a_chunk_short_of_blocks_shrinks_and_never_preempts_a_decode_already_in_the_step() -> None:
    # 12 blocks of 4 tokens. d0 (higher priority) decodes while p's prompt wants more than is free.
    sched = make_scheduler(target_itl_ms=None, max_num_batched_tokens=16, num_blocks=12)
    sched.add(make_request("d0", prompt_len=20, max_tokens=12, ignore_eos=True))
    sched.add(make_request("p", prompt_len=40, max_tokens=2))
    assert step(sched).num_scheduled_tokens == {"d0": 16}
    assert step(sched).num_scheduled_tokens == {"d0": 4, "p": 12}
    plan = step(sched)   # p wants 15 (4 blocks), 3 are free after d0's decode: it takes 12
    assert plan.num_scheduled_tokens == {"d0": 1, "p": 12} and not plan.preempted_ids
    plan = step(sched)   # no block is free: p waits, holding what it computed, and d0 goes on
    assert plan.num_scheduled_tokens == {"d0": 1} and not plan.preempted_ids
    assert sched.requests["p"].num_computed_tokens == 24 and sched.blocks.num_free_blocks == 0
    while "d0" in sched.requests:   # d0 outranks p, so p gives its blocks up when d0 needs one
        assert "d0" in step(sched).num_scheduled_tokens
    while "p" in sched.requests:
        plan = step(sched)
        assert not plan.preempted_ids


def test_closed_loop_steps_stay_near_the_target_once_the_model_has_learned() -> None:
    """An engine loop on a fake clock: each step takes what `truth` says (plus noise) and feeds the
    model. After a warm-up, steps that decode stay under the target (10 % slack for the noise)."""
    truth = StepCost(fixed_s=0.03, per_token_s=0.0025, per_context_token_s=2e-7)   # not the prior
    rng = random.Random(0)
    clock = FakeClock()
    model = StepCostModel()
    config = SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=512, target_itl_ms=200.0, min_prefill_chunk=16)
    sched = Scheduler(config, BlockManager(2048, 16), 4096, clock, model)
    over, decode_steps, arrivals = 0, 0, 0
    for index in range(600):
        if rng.random() < 0.15:
            sched.add(make_request(f"r{arrivals}", prompt_len=rng.randint(100, 600),
                                   max_tokens=rng.randint(16, 64), ignore_eos=True))
            arrivals += 1
        ready = {r.request_id for r in sched.running if r.num_tokens - r.num_computed_tokens == 1}
        plan = sched.schedule()
        if plan.is_empty:
            continue
        assert ready - set(plan.preempted_ids) <= set(plan.num_scheduled_tokens)   # no decode left out
        shape = StepShape.from_plan(plan)
        time_s = truth.predict_s(shape.num_tokens, shape.num_context_tokens) * (1 + rng.gauss(0, 0.03))
        clock.advance(time_s)
        sched.update(plan, [[TOKEN]] * len(plan.sampling_ids))
        model.observe(shape, time_s)
        decodes = [row for row in plan.rows if not row.is_prefill]
        decode_only_s = truth.predict_s(len(decodes), sum(r.start_position + 1 for r in decodes))
        if index >= 100 and decodes and decode_only_s < 0.2 * 0.8:
            decode_steps += 1
            over += time_s > 0.2 * 1.1
    assert decode_steps > 100 and over <= decode_steps // 50, (over, decode_steps)
    assert arrivals > 50 and sum(1 for r in sched.requests.values() if r.output_token_ids) > 0


# ------------------------------------------------------------------ long prompts


def test_a_long_prompt_lengthens_a_decoding_step_by_at_most_the_slowdown() -> None:
    sched = make_scheduler(target_itl_ms=200.0, long_prefill_max_slowdown=0.5, max_num_batched_tokens=256)
    start_decoding(sched, 6)
    sched.add(make_request("long", prompt_len=1000, max_tokens=2))   # more than 256 tokens: long
    plan = step(sched)
    # 6 decodes: 10 + 6 = 16 ms predicted; the long prompt may add half of that: 8 tokens at 1 ms.
    assert plan.num_decode_tokens == 6 and plan.num_scheduled_tokens["long"] == 8
    # Every step while it prefills: the same bound, and the decodes never wait.
    for _ in range(5):
        plan = step(sched)
        assert plan.num_decode_tokens == 6 and plan.num_scheduled_tokens["long"] == 8


def test_short_prompts_still_fill_the_target_beside_a_long_one() -> None:
    sched = make_scheduler(target_itl_ms=50.0, long_prefill_max_slowdown=0.5, max_num_batched_tokens=256)
    start_decoding(sched, 4)
    sched.add(make_request("long", prompt_len=1000, max_tokens=2))
    sched.add(make_request("short", prompt_len=30, max_tokens=2))
    plan = step(sched)
    # 14 ms of decodes; long gets 7 tokens (half of 14 ms); short the rest of the 50 ms target: 29.
    assert plan.num_scheduled_tokens["long"] == 7 and plan.num_scheduled_tokens["short"] == 29


def test_a_long_prompt_runs_at_full_speed_with_nothing_decoding_and_always_moves() -> None:
    sched = make_scheduler(target_itl_ms=200.0, long_prefill_max_slowdown=0.01, max_num_batched_tokens=256)
    sched.add(make_request("long", prompt_len=600, max_tokens=2))
    assert step(sched).num_scheduled_tokens == {"long": 256}   # nobody decodes: the whole chunk
    sched = make_scheduler(target_itl_ms=200.0, long_prefill_max_slowdown=0.01, max_num_batched_tokens=256)
    start_decoding(sched, 1)
    sched.add(make_request("long", prompt_len=600, max_tokens=2))
    # 1 decode: 11 ms; 1 % of it buys no whole token, yet the long prompt still gets one a step.
    assert [step(sched).num_scheduled_tokens for _ in range(2)] == [{"d0": 1, "long": 1}] * 2


def test_the_threshold_decides_what_is_long() -> None:
    sched = make_scheduler(target_itl_ms=200.0, long_prefill_max_slowdown=0.5, long_prefill_token_threshold=2000)
    start_decoding(sched, 6)
    sched.add(make_request("p", prompt_len=1000, max_tokens=2))   # under the threshold: the target rules
    assert step(sched).num_scheduled_tokens["p"] == 184            # 200 - 16 ms
