"""Sharing the batch: tenants take turns at admission (by weight, under a running cap), a better
priority preempts a running request when the batch or the KV cache is full, and a request is
preempted that way only a bounded number of times. Pure scheduler, fake clock."""

from __future__ import annotations

from helpers import FakeClock, make_request
from test_scheduler import audit, run_to_completion, step

from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.request import RequestStatus
from conveyor.core.scheduler import Scheduler


def make(num_blocks: int = 256, max_num_seqs: int = 2, **config) -> Scheduler:
    blocks = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, **config), blocks, 256,
                     FakeClock())


def admissions(sched: Scheduler, steps: int | None = None) -> list[str]:
    """Request ids in the order they first got a row."""
    order: list[str] = []
    count = 0
    while sched.has_unfinished() and (steps is None or count < steps):
        plan, _ = step(sched)
        order += [row.request_id for row in plan.rows if row.request_id not in order]
        count += 1
    return order


def test_a_single_request_of_another_tenant_waits_at_most_one_admission() -> None:
    sched = make()
    for i in range(20):
        sched.add(make_request(f"a{i}", max_tokens=3, tenant="A"))
    before = admissions(sched, steps=4)   # A has run for a while
    sched.add(make_request("b", max_tokens=3, tenant="B"))
    after = [rid for rid in admissions(sched) if rid not in before]
    assert "b" not in before and after.index("b") <= 1, after   # at most one of A's backlog went first
    assert len(after) - after.index("b") > 10                   # ... not all of it


def test_without_tenants_the_order_is_first_come_first_served() -> None:
    sched = make()
    for i in range(6):
        sched.add(make_request(f"r{i}", max_tokens=2))
    assert admissions(sched) == [f"r{i}" for i in range(6)]


def test_backlogged_tenants_are_served_in_proportion_to_their_weights() -> None:
    sched = make(max_num_seqs=1, tenant_weights=(("A", 3.0),))
    for i in range(40):
        sched.add(make_request(f"a{i}", max_tokens=2, tenant="A"))
        sched.add(make_request(f"b{i}", max_tokens=2, tenant="B"))
    first = admissions(sched, steps=3 * 32)[:32]
    share_a = sum(rid.startswith("a") for rid in first) / len(first)
    assert 0.65 <= share_a <= 0.85, first


def test_a_tenant_at_its_running_cap_leaves_the_slots_to_others() -> None:
    sched = make(max_num_seqs=4, max_running_per_tenant=2)
    for i in range(6):
        sched.add(make_request(f"a{i}", max_tokens=4, tenant="A"))
    sched.add(make_request("b0", max_tokens=4, tenant="B"))
    while sched.has_unfinished():
        step(sched)
        running_a = [r for r in sched.running if r.tenant == "A"]
        assert len(running_a) <= 2
    assert not sched.shares.counters and not sched.shares.live and not sched.shares.running


def test_a_better_priority_takes_the_place_of_a_running_request_when_the_batch_is_full() -> None:
    sched = make(max_num_seqs=2)
    low = [make_request(f"low{i}", max_tokens=6, priority=5) for i in range(2)]
    for r in low:
        sched.add(r)
    step(sched)
    step(sched)
    urgent = make_request("urgent", max_tokens=3, priority=0)
    sched.add(urgent)
    plan, _ = step(sched)
    assert plan.preempted_ids == ("low1",) and "urgent" in plan.num_scheduled_tokens
    assert low[1].status is RequestStatus.WAITING and len(low[1].output_token_ids) == 2   # tokens kept
    run_to_completion(sched)
    assert all(len(r.output_token_ids) == 6 for r in low) and len(urgent.output_token_ids) == 3


def test_a_better_priority_takes_kv_blocks_from_a_running_request() -> None:
    sched = make(num_blocks=6, max_num_seqs=8)
    hog = make_request("hog", prompt_len=16, max_tokens=4, priority=9)
    sched.add(hog)
    step(sched)                                   # 4 blocks of 6
    urgent = make_request("urgent", prompt_len=12, max_tokens=2, priority=0)
    sched.add(urgent)
    plan, _ = step(sched)
    assert plan.preempted_ids == ("hog",) and plan.num_scheduled_tokens.get("urgent") == 12
    audit(sched)
    run_to_completion(sched)
    assert hog.is_finished and len(hog.output_token_ids) == 4


def test_an_equal_or_worse_priority_never_preempts() -> None:
    sched = make(max_num_seqs=1)
    sched.add(make_request("first", max_tokens=4, priority=1))
    step(sched)
    sched.add(make_request("same", max_tokens=1, priority=1))
    sched.add(make_request("worse", max_tokens=1, priority=2))
    plan, _ = step(sched)
    assert plan.preempted_ids == () and list(plan.num_scheduled_tokens) == ["first"]


def test_a_request_is_preempted_for_priority_a_bounded_number_of_times() -> None:
    sched = make(max_num_seqs=1, max_priority_preemptions=2)
    victim = make_request("victim", max_tokens=40, priority=9)
    sched.add(victim)
    step(sched)
    for i in range(2):
        sched.add(make_request(f"urgent{i}", max_tokens=1, priority=0))
        plan, _ = step(sched)
        assert plan.preempted_ids == ("victim",)
        step(sched)                              # the urgent one is done; the victim comes back
        assert victim.status is RequestStatus.RUNNING
    sched.add(make_request("urgent-last", max_tokens=1, priority=0))
    plan, _ = step(sched)
    assert plan.preempted_ids == () and list(plan.num_scheduled_tokens) == ["victim"]
    run_to_completion(sched)
    assert victim.num_preemptions == 2 and len(victim.output_token_ids) == 40


def test_a_background_request_yields_to_better_priorities_however_often() -> None:
    sched = make(max_num_seqs=1, max_priority_preemptions=1)
    line = make_request("batch-line", max_tokens=40, priority=2**31)
    line.is_background = True
    sched.add(line)
    step(sched)
    for i in range(4):   # past max_priority_preemptions, a batch job's line still gives way
        sched.add(make_request(f"urgent{i}", max_tokens=1, priority=0))
        plan, _ = step(sched)
        assert plan.preempted_ids == ("batch-line",)
        step(sched)
    run_to_completion(sched)
    assert line.num_preemptions == 4 and len(line.output_token_ids) == 40
