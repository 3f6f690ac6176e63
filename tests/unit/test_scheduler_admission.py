"""No prompt waits behind a longer one: waiting prompts are admitted ahead of a started prompt's next
chunk, the chunk keeps its floor, priorities and tenants keep their order, a prompt waits for a
shared prefix another is computing, and queue time is split by cause. Fake clock; no model."""

from __future__ import annotations

from helpers import FakeClock, audit_blocks, make_request

from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.plan import StepPlan
from conveyor.core.request import WAIT_CAUSES
from conveyor.core.scheduler import Scheduler
from conveyor.core.step_cost import StepCost, StepCostModel, StepShape

TOKEN = 7
# 10 ms a step plus 1 ms a token; with no samples the model's cost is its prior, exactly.
KNOWN = StepCost(fixed_s=0.01, per_token_s=0.001, per_context_token_s=0.0)


def make(target_itl_ms: float | None = None, num_blocks: int = 1024, block_size: int = 4,
         enable_prefix_caching: bool = False, clock: FakeClock | None = None, **config) -> Scheduler:
    config = {"max_num_seqs": 32, "max_num_batched_tokens": 256, "min_prefill_chunk": 16, **config}
    cost_model = StepCostModel(prior=KNOWN) if target_itl_ms is not None else None
    return Scheduler(SchedulerConfig(target_itl_ms=target_itl_ms, **config),
                     BlockManager(num_blocks, block_size, enable_prefix_caching), 8192, clock or FakeClock(),
                     cost_model)


def step(sched: Scheduler, clock: FakeClock | None = None) -> StepPlan:
    plan = sched.schedule()
    if clock is not None:
        clock.advance(KNOWN.predict_s(StepShape.from_plan(plan).num_tokens, 0))
    sched.update(plan, [[TOKEN]] * len(plan.sampling_ids))
    audit_blocks(sched.blocks, list(sched.requests.values()))
    return plan


def test_a_short_prompt_is_admitted_in_the_next_step_ahead_of_a_long_prompts_chunk() -> None:
    sched = make()
    sched.add(make_request("long", prompt_len=1000, max_tokens=2))
    assert step(sched).num_scheduled_tokens == {"long": 256}   # alone, nothing decoding: the whole budget
    sched.add(make_request("short", prompt_len=16, max_tokens=2))
    plan = step(sched)
    assert [row.request_id for row in plan.rows] == ["short", "long"]
    assert plan.num_scheduled_tokens == {"short": 16, "long": 240} and plan.sampling_ids == ["short"]


def test_with_a_target_the_step_carrying_a_first_token_is_held_to_it() -> None:
    # Nothing decodes, so the long prompt alone takes the whole budget; once a short prompt's first
    # token rides on the step, the long chunk is cut to the 50 ms target (at least its floor).
    sched = make(target_itl_ms=50.0)
    sched.add(make_request("long", prompt_len=1000, max_tokens=2))
    assert step(sched).num_scheduled_tokens == {"long": 256}
    sched.add(make_request("short", prompt_len=8, max_tokens=2))
    plan = step(sched)
    assert plan.num_scheduled_tokens["short"] == 8 and plan.num_scheduled_tokens["long"] >= 16
    assert KNOWN.predict_s(StepShape.from_plan(plan).num_tokens, 0) <= 0.050


def test_a_long_prompt_alone_takes_at_most_long_prefill_max_chunk_so_newcomers_wait_little() -> None:
    def first_chunks(prompt_len: int, **config) -> list[int]:
        sched = make(target_itl_ms=200.0, max_num_batched_tokens=512, **config)
        sched.add(make_request("p", prompt_len=prompt_len, max_tokens=2))
        return [step(sched).num_scheduled_tokens["p"] for _ in range(2)]

    assert first_chunks(2000) == [256, 256]
    assert first_chunks(2000, long_prefill_max_chunk=100) == [100, 100]
    assert first_chunks(2000, long_prefill_max_chunk=None) == [512, 512]
    assert first_chunks(500) == [500, 1]                 # not long: the whole prompt at once


def test_the_long_prompt_keeps_its_floor_however_many_short_prompts_wait() -> None:
    sched = make()
    sched.add(make_request("long", prompt_len=600, max_tokens=2))
    step(sched)
    for i in range(40):
        sched.add(make_request(f"s{i}", prompt_len=30, max_tokens=50, ignore_eos=True))
    plan = step(sched)
    assert plan.num_scheduled_tokens["long"] == 16                     # min_prefill_chunk
    assert sum(plan.num_scheduled_tokens.values()) <= 256
    assert [rid for rid in plan.num_scheduled_tokens if rid.startswith("s")] == [f"s{i}" for i in range(8)]


def test_a_stream_of_short_prompts_never_starves_the_long_one() -> None:
    for target_itl_ms in (None, 50.0):
        sched = make(target_itl_ms=target_itl_ms)
        long = make_request("long", prompt_len=2000, max_tokens=2)
        sched.add(long)
        steps = 0
        while long.num_computed_tokens < long.num_prompt_tokens:
            before = long.num_computed_tokens
            for i in range(3):
                sched.add(make_request(f"s{steps}.{i}", prompt_len=12, max_tokens=4))
            step(sched)
            steps += 1
            # Beside decodes the long-prompt cap (a share of their time) rules, as without the shorts.
            assert long.num_computed_tokens - before >= (16 if target_itl_ms is None else 1)
        assert steps <= 2000 // 16


def test_a_worse_priority_short_prompt_does_not_go_ahead_but_a_better_one_does() -> None:
    sched = make()
    sched.add(make_request("long", prompt_len=1000, max_tokens=2, priority=1))
    step(sched)
    sched.add(make_request("worse", prompt_len=8, max_tokens=2, priority=2))
    sched.add(make_request("better", prompt_len=8, max_tokens=2, priority=0))
    plan = step(sched)
    assert plan.num_scheduled_tokens == {"better": 8, "long": 248}
    assert [r.request_id for r in sched.waiting] == ["worse"] and sched.waiting[0].wait_cause == "priority"


def test_a_waiting_long_prompt_of_better_priority_is_not_passed_by_shorter_worse_ones() -> None:
    sched = make(max_num_batched_tokens=128)
    sched.add(make_request("long", prompt_len=1000, max_tokens=2, priority=1))
    step(sched)
    sched.add(make_request("long0", prompt_len=900, max_tokens=2, priority=0))
    sched.add(make_request("short1", prompt_len=8, max_tokens=2, priority=1))
    plan = step(sched)
    # long0 needs more than long's remaining 872, and it outranks short1: nobody goes ahead.
    assert plan.num_scheduled_tokens == {"long": 128}
    assert [r.request_id for r in sched.waiting] == ["long0", "short1"]


def test_shorter_prompts_pass_a_longer_waiting_one_of_the_same_priority() -> None:
    sched = make(max_num_batched_tokens=128)
    sched.add(make_request("long", prompt_len=1000, max_tokens=2))
    step(sched)
    sched.add(make_request("doc", prompt_len=900, max_tokens=2))   # longer than long's remaining 872
    sched.add(make_request("chat", prompt_len=8, max_tokens=2))
    plan = step(sched)
    assert plan.num_scheduled_tokens == {"chat": 8, "long": 120}
    assert [r.request_id for r in sched.waiting] == ["doc"]


def test_started_prompts_go_shortest_remaining_first() -> None:
    sched = make(max_num_batched_tokens=64, min_prefill_chunk=8)
    sched.add(make_request("a", prompt_len=300, max_tokens=2))
    sched.add(make_request("b", prompt_len=100, max_tokens=2))
    assert step(sched).num_scheduled_tokens == {"a": 64}   # arrival order among new prompts
    assert step(sched).num_scheduled_tokens == {"b": 56, "a": 8}   # b went ahead of a's chunk
    assert step(sched).num_scheduled_tokens == {"b": 44, "a": 20}  # b, started, needs less: first


def test_tenants_keep_their_turns_and_caps_ahead_of_a_long_chunk() -> None:
    sched = make(max_running_per_tenant=2)
    sched.add(make_request("long", prompt_len=1000, max_tokens=2, tenant="A"))
    step(sched)
    for i in range(3):
        sched.add(make_request(f"a{i}", prompt_len=8, max_tokens=4, tenant="A"))
        sched.add(make_request(f"b{i}", prompt_len=8, max_tokens=4, tenant="B"))
    plan = step(sched)
    ahead = [row.request_id for row in plan.rows if row.request_id != "long"]
    # A runs long already, so it has one slot left; B takes turns with it and stops at its cap.
    assert ahead == ["a0", "b0", "b1"]
    assert {r.request_id: r.wait_cause for r in sched.waiting} == {"a1": "priority", "a2": "priority",
                                                                    "b2": "priority"}


def test_short_prompts_leave_the_long_chunk_the_blocks_of_its_floor() -> None:
    # 25 blocks of 4 tokens; d decodes beside the long prompt, whose floor is 8 tokens (2 blocks).
    sched = make(num_blocks=25, max_num_batched_tokens=64, min_prefill_chunk=8)
    sched.add(make_request("d", prompt_len=36, max_tokens=20, ignore_eos=True))
    sched.add(make_request("long", prompt_len=90, max_tokens=2))
    assert step(sched).num_scheduled_tokens == {"d": 36, "long": 28}   # 16 blocks held, 9 free
    sched.add(make_request("s0", prompt_len=16, max_tokens=2))    # 4 blocks: fits beside the floor's 2
    sched.add(make_request("s1", prompt_len=16, max_tokens=2))    # 4 more would take the floor's blocks
    plan = step(sched)
    assert plan.num_scheduled_tokens == {"d": 1, "s0": 16, "long": 16} and not plan.preempted_ids
    assert sched.waiting[0].request_id == "s1" and sched.waiting[0].wait_cause == "blocks"


def test_a_preempted_request_is_not_readmitted_ahead_in_the_same_step() -> None:
    sched = make(num_blocks=12, max_num_batched_tokens=16, min_prefill_chunk=4)
    sched.add(make_request("d0", prompt_len=20, max_tokens=20, ignore_eos=True))
    sched.add(make_request("p", prompt_len=40, max_tokens=2))
    while True:
        plan = step(sched)
        if plan.preempted_ids:
            break
        assert len(plan.rows) <= 2
    (victim,) = plan.preempted_ids
    assert victim not in plan.num_scheduled_tokens
    while sched.has_unfinished():
        step(sched)


def test_prompts_sharing_a_prefix_wait_for_the_one_computing_it() -> None:
    prefix = [1000 + i for i in range(400)]
    sched = make(enable_prefix_caching=True, block_size=16)
    requests = [make_request(f"r{i}", prompt=prefix + [50 + i] * 20, max_tokens=2) for i in range(8)]
    for request in requests:
        sched.add(request)
    computed = step(sched).num_prefill_tokens   # r0 takes the whole budget; the rest wait
    while sched.has_unfinished():
        plan = step(sched)
        computed += plan.num_prefill_tokens
        for request in sched.waiting:
            assert request.wait_cause == "prefix"
    distinct = len(prefix) + 8 * 20
    assert computed <= 1.2 * distinct, computed
    assert [r.num_cached_tokens for r in requests] == [0] + [400] * 7


def test_a_better_priority_never_waits_on_a_worse_ones_prefix() -> None:
    prefix = [1000 + i for i in range(400)]
    sched = make(enable_prefix_caching=True, block_size=16)
    sched.add(make_request("worse", prompt=prefix + [1], max_tokens=2, priority=1))
    step(sched)
    sched.add(make_request("better", prompt=prefix + [2], max_tokens=2, priority=0))
    plan = step(sched)
    assert plan.num_scheduled_tokens["better"] > 0


def test_a_request_that_skips_the_cache_never_waits_for_a_prefix_in_flight() -> None:
    # cache_prompt: false (or a prompt to score) computes every block itself: it has no hashes to wait on
    import dataclasses

    prefix = [1000 + i for i in range(400)]
    sched = make(enable_prefix_caching=True, block_size=16)
    sched.add(make_request("first", prompt=prefix + [1], max_tokens=2))
    step(sched)
    skipping = make_request("skipping", prompt=prefix + [2], max_tokens=2)
    skipping.params = dataclasses.replace(skipping.params, use_prefix_cache=False)
    sched.add(skipping)
    while "skipping" not in step(sched).num_scheduled_tokens:
        assert skipping.wait_cause != "prefix"
    assert skipping.num_cached_tokens == 0


def test_queue_time_is_split_by_cause_and_adds_up() -> None:
    clock = FakeClock()
    sched = make(clock=clock, max_num_seqs=2, enable_prefix_caching=True, block_size=16)
    prefix = [1000 + i for i in range(300)]
    sched.add(make_request("a", prompt=prefix + [1], max_tokens=3))
    sched.add(make_request("b", prompt=prefix + [2], max_tokens=3))          # waits for a's prefix
    sched.add(make_request("c", prompt_len=8, max_tokens=30, ignore_eos=True))
    sched.add(make_request("d", prompt_len=8, max_tokens=3))                 # waits for a seat
    requests = dict(sched.requests)
    while sched.has_unfinished():
        step(sched, clock)
    for request in requests.values():
        assert set(request.queue_s_by_cause) <= set(WAIT_CAUSES)
        assert abs(sum(request.queue_s_by_cause.values()) - (request.first_scheduled_s - request.arrival_s)) < 1e-9
    assert requests["b"].queue_s_by_cause.get("prefix", 0) > 0
    assert requests["d"].queue_s_by_cause.get("budget", 0) > 0
    assert requests["a"].queue_s_by_cause.get("budget", 0) == 0 == requests["a"].first_scheduled_s
