"""Scheduler with hand-built requests and hand-fed sampled tokens: budgets, chunking, stops,
preemption and resume, priority (abort, refusal at add() and prefix caching: test_scheduler_abort_prefix.py).
No model."""

from __future__ import annotations

from collections.abc import Mapping

from helpers import EOS, FakeClock, audit_blocks, make_request

from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.plan import StepPlan, StepResult
from conveyor.core.request import FinishReason, RequestStatus
from conveyor.core.scheduler import Scheduler

TOKEN = 7  # a sampled token that stops nothing


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int = 256,
                   enable_prefix_caching: bool = False,
                   clock: FakeClock | None = None) -> tuple[Scheduler, BlockManager]:
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, blocks, max_model_len, clock or FakeClock()), blocks


def audit(sched: Scheduler) -> None:
    audit_blocks(sched.blocks, list(sched.requests.values()))
    for request in sched.waiting:
        assert request.status is RequestStatus.WAITING and request.block_table == []
    for request in sched.running:
        assert request.status is RequestStatus.RUNNING


def step(sched: Scheduler, tokens: Mapping[str, int] | None = None) -> tuple[StepPlan, StepResult]:
    """One schedule + update; each sampling row gets tokens[id] (default TOKEN)."""
    plan = sched.schedule()
    sampled = [(tokens or {}).get(rid, TOKEN) for rid in plan.sampling_ids]
    result = sched.update(plan, [[t] for t in sampled])
    audit(sched)
    return plan, result


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[StepPlan]:
    plans = []
    while sched.has_unfinished():
        assert len(plans) < max_steps, "scheduler made no progress"
        plans.append(step(sched)[0])
    return plans


# ------------------------------------------------------------ the STYLE.md example

def test_running_request_preempts_newest_when_blocks_run_out() -> None:
    blocks = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), blocks, 64, FakeClock())
    a, b = make_request("a", prompt_len=8), make_request("b", prompt_len=7)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"a": 8, "b": 7}
    sched.update(plan, [[11], [12]])
    plan = sched.schedule()                   # a's 9th token needs a 3rd block; none free
    assert plan.preempted_ids == ("b",) and b.status is RequestStatus.WAITING
    assert plan.num_scheduled_tokens == {"a": 1} and blocks.num_free_blocks == 1
    assert b.output_token_ids == [12] and b.block_table == [] and b.num_computed_tokens == 0
    audit(sched)


# ------------------------------------------------------------ budgets and chunks

def test_long_prompt_is_chunked_and_only_the_last_chunk_samples() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=16)
    a = make_request("a", prompt_len=50, max_tokens=3)
    sched.add(a)
    rows = []
    for _ in range(4):
        plan, result = step(sched)
        assert len(plan.rows) == 1
        rows.append(plan.rows[0])
    assert [r.num_tokens for r in rows] == [16, 16, 16, 2]
    assert [r.start_position for r in rows] == [0, 16, 32, 48]
    assert [r.is_sampling for r in rows] == [False, False, False, True]
    assert all(r.is_prefill for r in rows)
    assert [t for r in rows for t in r.token_ids] == a.prompt_token_ids
    assert all(len(r.block_table) * 4 >= r.start_position + r.num_tokens for r in rows)
    assert a.output_token_ids == [TOKEN] and a.num_computed_tokens == 50
    assert [u.new_token_ids for u in result.updates] == [[TOKEN]]

    plan, _ = step(sched)                     # decode: one token, the one just sampled
    (row,) = plan.rows
    assert (row.num_tokens, row.start_position, row.token_ids) == (1, 50, [TOKEN])
    assert row.is_sampling and not row.is_prefill
    assert plan.num_decode_tokens == 1 and plan.num_prefill_tokens == 0


def test_token_budget_and_max_num_seqs_are_respected() -> None:
    sched, _ = make_scheduler(max_num_seqs=3, max_num_batched_tokens=16)
    for i in range(5):
        sched.add(make_request(f"r{i}", prompt_len=10, max_tokens=3))
    plan, _ = step(sched)
    assert plan.num_scheduled_tokens == {"r0": 10, "r1": 6}      # r1's prompt is cut to the budget
    assert plan.sampling_ids == ["r0"]
    for plan in run_to_completion(sched):
        assert sum(r.num_tokens for r in plan.rows) <= 16
        assert len(plan.rows) <= 3
        assert sched.num_running <= 3


def test_decodes_are_scheduled_before_new_prompt_chunks() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", prompt_len=5, max_tokens=10)
    sched.add(a)
    step(sched)
    step(sched)
    b = make_request("b", prompt_len=20, max_tokens=2)
    sched.add(b)
    plan, _ = step(sched)
    assert [(r.request_id, r.num_tokens, r.is_prefill) for r in plan.rows] == [("a", 1, False), ("b", 7, True)]
    plan, _ = step(sched)
    assert [(r.request_id, r.num_tokens) for r in plan.rows] == [("a", 1), ("b", 7)]


def test_request_joins_mid_generation_of_another() -> None:
    sched, blocks = make_scheduler()
    a = make_request("a", prompt_len=6, max_tokens=6)
    sched.add(a)
    step(sched, {"a": 1})
    step(sched, {"a": 3})
    b = make_request("b", prompt_len=9, max_tokens=3)
    sched.add(b)
    plan, _ = step(sched, {"a": 4, "b": 20})
    assert plan.num_scheduled_tokens == {"a": 1, "b": 9} and plan.sampling_ids == ["a", "b"]
    step(sched, {"a": 5, "b": 21})
    step(sched, {"a": 6, "b": 22})
    assert b.is_finished and b.output_token_ids == [20, 21, 22] and b.finish_reason is FinishReason.LENGTH
    plan, _ = step(sched, {"a": 8})
    assert plan.finished_ids == ("b",) and plan.num_scheduled_tokens == {"a": 1}
    assert a.is_finished and a.output_token_ids == [1, 3, 4, 5, 6, 8]
    assert blocks.num_free_blocks == blocks.num_blocks


def test_max_num_seqs_admits_the_next_request_when_one_finishes() -> None:
    sched, _ = make_scheduler(max_num_seqs=2)
    for rid, max_tokens in (("a", 2), ("b", 4), ("c", 1)):
        sched.add(make_request(rid, prompt_len=4, max_tokens=max_tokens))
    assert step(sched)[0].num_scheduled_tokens == {"a": 4, "b": 4}
    assert step(sched)[0].num_scheduled_tokens == {"a": 1, "b": 1}     # a finishes here
    assert sched.num_running == 1
    assert step(sched)[0].num_scheduled_tokens == {"b": 1, "c": 4}


# ------------------------------------------------------------ stopping

def test_finish_on_eos_frees_blocks_and_reports_in_next_plan() -> None:
    clock = FakeClock(100.0)
    sched, blocks = make_scheduler(clock=clock)
    a = make_request("a", prompt_len=6, max_tokens=10)
    sched.add(a)
    clock.advance()
    step(sched)
    clock.advance()
    _, result = step(sched, {"a": EOS})
    (update,) = result.updates
    assert (update.new_token_ids, update.finish_reason, update.stop_reason) == ([EOS], FinishReason.STOP, None)
    assert a.is_finished and a.finish_reason is FinishReason.STOP and a.output_token_ids == [TOKEN, EOS]
    assert a.block_table == [] and blocks.num_free_blocks == blocks.num_blocks
    assert (a.first_scheduled_s, a.first_token_s, a.last_token_s, a.finished_s) == (101.0, 101.0, 102.0, 102.0)
    assert not sched.has_unfinished()
    assert sched.schedule().finished_ids == ("a",)
    assert sched.schedule().finished_ids == ()


def test_eos_is_ignored_before_min_tokens() -> None:
    sched, _ = make_scheduler()
    a = make_request("a", max_tokens=10, min_tokens=3)
    sched.add(a)
    step(sched, {"a": EOS})
    step(sched, {"a": EOS})
    assert not a.is_finished
    step(sched, {"a": EOS})
    assert a.is_finished and a.finish_reason is FinishReason.STOP and a.output_token_ids == [EOS] * 3


def test_ignore_eos_runs_to_max_tokens() -> None:
    sched, _ = make_scheduler()
    a = make_request("a", max_tokens=4, ignore_eos=True)
    sched.add(a)
    for _ in range(4):
        step(sched, {"a": EOS})
    assert a.is_finished and a.finish_reason is FinishReason.LENGTH and a.output_token_ids == [EOS] * 4


def test_stop_token_ids_set_stop_reason() -> None:
    sched, _ = make_scheduler()
    a = make_request("a", max_tokens=10, stop_token_ids=[42, 43])
    sched.add(a)
    step(sched, {"a": 41})
    _, result = step(sched, {"a": 43})
    assert result.updates[0].finish_reason is FinishReason.STOP and result.updates[0].stop_reason == 43
    assert a.finish_reason is FinishReason.STOP and a.stop_reason == 43 and a.output_token_ids == [41, 43]


def test_max_tokens_finishes_with_length() -> None:
    sched, blocks = make_scheduler()
    a = make_request("a", prompt_len=5, max_tokens=3)
    sched.add(a)
    step(sched)
    step(sched)
    assert not a.is_finished
    _, result = step(sched)
    assert result.updates[0].finish_reason is FinishReason.LENGTH
    assert a.finish_reason is FinishReason.LENGTH and len(a.output_token_ids) == 3
    assert blocks.num_free_blocks == blocks.num_blocks


def test_max_tokens_up_to_the_model_length_runs_to_it() -> None:
    sched, _ = make_scheduler(max_model_len=16)
    a = make_request("a", prompt_len=10, max_tokens=6)   # admission resolves max_tokens None to this
    sched.add(a)
    plans = run_to_completion(sched)
    assert len(plans) == 6
    assert a.finish_reason is FinishReason.LENGTH and a.num_tokens == 16 and len(a.output_token_ids) == 6


def test_finish_from_outside_with_a_stop_string() -> None:
    sched, blocks = make_scheduler()
    a = make_request("a", max_tokens=10)
    sched.add(a)
    step(sched)
    sched.finish("a", FinishReason.STOP, "###")
    assert a.finish_reason is FinishReason.STOP and a.stop_reason == "###"
    assert blocks.num_free_blocks == blocks.num_blocks and not sched.has_unfinished()
    sched.finish("a", FinishReason.STOP, "again")       # already gone: a no-op
    assert a.stop_reason == "###"
    assert sched.schedule().finished_ids == ("a",)


# ------------------------------------------------------------ preemption and resume

def test_preempted_request_resumes_by_recomputing_prompt_and_outputs() -> None:
    sched, blocks = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    a = make_request("a", prompt_len=8, max_tokens=5)
    b = make_request("b", prompt_len=7, max_tokens=4)
    sched.add(a)
    sched.add(b)
    step(sched, {"a": 11, "b": 12})
    plan, _ = step(sched, {"a": 13})
    assert plan.preempted_ids == ("b",) and b.num_preemptions == 1 and sched.num_preemptions == 1
    assert b.status is RequestStatus.WAITING and b.output_token_ids == [12] and b.block_table == []
    # a owns 3 of the 4 blocks until it finishes; b cannot come back before then.
    while not a.is_finished:
        plan, _ = step(sched, {"a": 14})
        assert "b" not in plan.num_scheduled_tokens
    assert a.finish_reason is FinishReason.LENGTH and a.output_token_ids == [11, 13, 14, 14, 14]

    plan, _ = step(sched, {"b": 15})
    assert plan.finished_ids == ("a",)
    (row,) = plan.rows
    assert row.request_id == "b" and row.start_position == 0 and row.num_tokens == 8
    assert row.token_ids == b.prompt_token_ids + [12]
    assert row.is_prefill and row.is_sampling
    assert b.output_token_ids == [12, 15]
    plan, _ = step(sched, {"b": 16})
    assert plan.rows[0].token_ids == [15] and not plan.rows[0].is_prefill
    run_to_completion(sched)
    assert b.output_token_ids == [12, 15, 16, TOKEN] and b.finish_reason is FinishReason.LENGTH
    assert blocks.num_free_blocks == 4


def test_preempted_request_resumes_with_a_chunked_recompute() -> None:
    sched, _ = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=5, max_model_len=64)
    a = make_request("a", prompt_len=4, max_tokens=14)
    b = make_request("b", prompt=[50, 51], max_tokens=12)
    sched.add(a)
    sched.add(b)
    outputs = {"a": 100, "b": 200}
    seen_b: list[int] = []
    plans = []
    while sched.has_unfinished():
        assert len(plans) < 100
        plan = sched.schedule()
        plans.append(plan)
        if "b" in plan.preempted_ids:
            assert b.output_token_ids == seen_b and b.block_table == []
        sampled = []
        for rid in plan.sampling_ids:
            outputs[rid] += 1
            sampled.append(outputs[rid])
        sched.update(plan, [[t] for t in sampled])
        audit(sched)
        assert b.output_token_ids[:len(seen_b)] == seen_b     # never loses a token
        seen_b = list(b.output_token_ids)
    assert any("b" in p.preempted_ids for p in plans)
    # The last resume recomputes b's 2 prompt + 7 output tokens in chunks of the 5-token budget.
    last_preempt = max(i for i, p in enumerate(plans) if "b" in p.preempted_ids)
    resume = [row for p in plans[last_preempt + 1:] for row in p.rows if row.request_id == "b"][:2]
    assert [(r.start_position, r.num_tokens, r.is_sampling, r.is_prefill) for r in resume] == [
        (0, 5, False, True), (5, 4, True, True)]
    assert resume[0].token_ids + resume[1].token_ids == [50, 51] + list(range(201, 208))
    assert b.output_token_ids == list(range(201, 213)) and b.finish_reason is FinishReason.LENGTH
    assert a.output_token_ids == list(range(101, 115))


def test_no_request_is_admitted_in_a_step_that_preempted() -> None:
    sched, _ = make_scheduler(num_blocks=4, block_size=4)
    sched.add(make_request("a", prompt_len=8, max_tokens=6))
    sched.add(make_request("b", prompt_len=7, max_tokens=4))
    step(sched)
    sched.add(make_request("c", prompt_len=1, max_tokens=1))
    plan, _ = step(sched)
    assert plan.preempted_ids == ("b",) and set(plan.num_scheduled_tokens) == {"a"}


# ------------------------------------------------------------ priority

def test_lower_priority_value_is_admitted_first_and_fcfs_among_equals() -> None:
    sched, _ = make_scheduler(max_num_seqs=1)
    for rid, priority in (("late", 5), ("x", 1), ("urgent", 0), ("y", 1)):
        sched.add(make_request(rid, max_tokens=1, priority=priority))
    order = [next(iter(p.num_scheduled_tokens)) for p in run_to_completion(sched)]
    assert order == ["urgent", "x", "y", "late"]


def test_preemption_picks_the_lowest_priority_running_request() -> None:
    sched, _ = make_scheduler(num_blocks=6, block_size=4, max_model_len=64)
    a = make_request("a", prompt_len=8, max_tokens=8, priority=0)
    low = make_request("low", prompt_len=8, max_tokens=8, priority=9)
    mid = make_request("mid", prompt_len=8, max_tokens=8, priority=1)   # the newest, yet kept
    for r in (a, low, mid):
        sched.add(r)
    plan, _ = step(sched)
    assert [r.request_id for r in plan.rows] == ["a", "mid", "low"]
    plan, _ = step(sched)
    assert plan.preempted_ids == ("low",)
    assert [r.request_id for r in sched.running] == ["a", "mid"]
    assert low.status is RequestStatus.WAITING and len(low.output_token_ids) == 1


def test_newest_is_preempted_among_equal_priorities() -> None:
    sched, _ = make_scheduler(num_blocks=6, block_size=4, max_model_len=64)
    for rid in ("a", "b", "c"):
        sched.add(make_request(rid, prompt_len=8, max_tokens=8))
    step(sched)
    plan, _ = step(sched)
    assert plan.preempted_ids == ("c",)


def test_a_request_preempts_itself_when_it_is_the_lowest_priority() -> None:
    sched, blocks = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    a = make_request("a", prompt_len=8, max_tokens=5)
    b = make_request("b", prompt_len=4, max_tokens=5)
    sched.add(a)
    sched.add(b)
    step(sched)                               # a: 2 blocks, b: 1 block
    plan, _ = step(sched)                     # a takes the last block; b needs one too: b yields
    assert plan.preempted_ids == ("b",) and plan.num_scheduled_tokens == {"a": 1}
    assert blocks.num_free_blocks == 1 and b.status is RequestStatus.WAITING
    run_to_completion(sched)
    assert a.is_finished and b.is_finished and len(b.output_token_ids) == 5
