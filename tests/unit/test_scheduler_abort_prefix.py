"""Scheduler with hand-built requests (the helpers of test_scheduler.py): abort in every state, refusal at
add(), prefix caching through the scheduler. No model."""

from __future__ import annotations

import pytest
from helpers import make_request
from test_scheduler import TOKEN, audit, make_scheduler, run_to_completion, step

from conveyor.core.request import FinishReason, RequestStatus
from conveyor.errors import InvalidRequest


# ------------------------------------------------------------ abort

def test_abort_waiting_request() -> None:
    sched, _ = make_scheduler(max_num_seqs=1)
    sched.add(make_request("a"))
    b = make_request("b")
    sched.add(b)
    step(sched)
    assert b.status is RequestStatus.WAITING
    assert sched.abort("b") is True
    assert b.is_finished and b.finish_reason is FinishReason.ABORT and sched.num_waiting == 0
    audit(sched)
    plan = sched.schedule()
    assert plan.finished_ids == ("b",) and "b" not in plan.num_scheduled_tokens


def test_abort_running_mid_prefill_frees_blocks_now() -> None:
    sched, blocks = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", prompt_len=30)
    sched.add(a)
    step(sched)
    assert a.num_computed_tokens == 8 and blocks.num_used_blocks == 2
    assert sched.abort("a") is True
    assert blocks.num_free_blocks == blocks.num_blocks and a.block_table == [] and sched.num_running == 0
    audit(sched)
    plan = sched.schedule()
    assert plan.finished_ids == ("a",) and plan.is_empty


def test_abort_decoding_request_and_again_and_unknown() -> None:
    sched, blocks = make_scheduler()
    a, b = make_request("a", max_tokens=10), make_request("b", max_tokens=10)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    assert sched.abort("a") is True
    assert a.finish_reason is FinishReason.ABORT and a.output_token_ids == [TOKEN, TOKEN]
    audit(sched)
    assert blocks.num_used_blocks == len(b.block_table)
    assert sched.abort("a") is False                # already finished
    assert sched.abort("nope") is False
    plan, _ = step(sched)
    assert plan.finished_ids == ("a",) and plan.num_scheduled_tokens == {"b": 1}


def test_abort_preempted_request() -> None:
    sched, blocks = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    sched.add(make_request("a", prompt_len=8, max_tokens=5))
    b = make_request("b", prompt_len=7, max_tokens=4)
    sched.add(b)
    step(sched)
    plan, _ = step(sched)
    assert plan.preempted_ids == ("b",)
    assert sched.abort("b") is True and b.finish_reason is FinishReason.ABORT
    audit(sched)
    assert sched.schedule().finished_ids == ("b",)


def test_abort_finished_request_returns_false() -> None:
    sched, _ = make_scheduler()
    a = make_request("a", max_tokens=1)
    sched.add(a)
    step(sched)
    assert a.is_finished
    assert sched.abort("a") is False
    assert a.finish_reason is FinishReason.LENGTH
    assert sched.schedule().finished_ids == ("a",)       # once, from the finish, not the abort


def test_update_tolerates_a_row_aborted_after_schedule() -> None:
    sched, blocks = make_scheduler()
    a, b, c = make_request("a"), make_request("b"), make_request("c")
    for r in (a, b, c):
        sched.add(r)
    plan = sched.schedule()
    assert plan.sampling_ids == ["a", "b", "c"]
    assert sched.abort("b") is True
    result = sched.update(plan, [[31], [32], [33]])
    audit(sched)
    assert [(u.request_id, u.new_token_ids) for u in result.updates] == [("a", [31]), ("c", [33])]
    assert b.output_token_ids == [] and b.num_computed_tokens == 0
    assert a.output_token_ids == [31] and c.output_token_ids == [33]
    assert blocks.num_used_blocks == len(a.block_table) + len(c.block_table)
    assert sched.schedule().finished_ids == ("b",)


# ------------------------------------------------------------ add(): admission decided the fit

def test_duplicate_request_id_is_refused() -> None:
    sched, _ = make_scheduler()
    first = make_request("a")
    sched.add(first)
    with pytest.raises(InvalidRequest):
        sched.add(make_request("a"))
    assert sched.requests["a"] is first and sched.num_waiting == 1


def test_a_request_admission_would_refuse_is_a_bug() -> None:
    """Whether a request fits is admission's decision (tests/unit/test_front.py); the scheduler trusts it."""
    sched, _ = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(AssertionError):
        sched.add(make_request("long", prompt_len=28, max_tokens=5))
    with pytest.raises(AssertionError):
        sched.add(make_request("too_big", prompt_len=12, max_tokens=5))
    assert not sched.has_unfinished()


# ------------------------------------------------------------ prefix caching through the scheduler

def test_shared_prefix_is_reused_and_its_blocks_are_shared() -> None:
    sched, blocks = make_scheduler(enable_prefix_caching=True)
    a = make_request("a", prompt=list(range(10, 23)), max_tokens=4)      # 13 tokens: 3 full blocks
    sched.add(a)
    step(sched)
    b = make_request("b", prompt=list(range(10, 22)) + [99, 98], max_tokens=4)
    sched.add(b)
    plan, _ = step(sched)
    row = plan.rows[1]
    assert row.request_id == "b" and row.start_position == 12 and row.token_ids == [99, 98]
    assert b.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    assert [blocks.ref_counts[x] for x in a.block_table[:3]] == [2, 2, 2]
    assert blocks.num_hit_tokens == 12
    run_to_completion(sched)
    assert blocks.num_free_blocks == blocks.num_blocks
    c = make_request("c", prompt=list(range(10, 23)), max_tokens=2)
    sched.add(c)
    plan, _ = step(sched)
    assert plan.rows[0].start_position == 12 and c.num_cached_tokens == 12


def test_prefix_caching_off_recomputes_everything() -> None:
    sched, _ = make_scheduler(enable_prefix_caching=False)
    sched.add(make_request("a", prompt_len=13, max_tokens=1))
    run_to_completion(sched)
    b = make_request("b", prompt_len=13, max_tokens=1)
    sched.add(b)
    plan, _ = step(sched)
    assert plan.rows[0].start_position == 0 and b.num_cached_tokens == 0


def test_resumed_request_reuses_what_is_left_of_its_cached_blocks() -> None:
    sched, blocks = make_scheduler(num_blocks=5, block_size=4, enable_prefix_caching=True, max_model_len=64)
    a = make_request("a", prompt_len=8, max_tokens=9)
    b = make_request("b", prompt=[50 + i for i in range(9)], max_tokens=3)
    sched.add(a)
    sched.add(b)
    step(sched)                           # a: 2 blocks, b: 3 blocks, pool full
    plan, _ = step(sched)                 # a needs a 3rd block: b goes, its 2 full blocks stay cached
    assert plan.preempted_ids == ("b",)
    while not a.is_finished:              # a grows to 4 blocks: b's partial, then b's tail block
        step(sched)
    plan, _ = step(sched)
    (row,) = plan.rows
    assert (row.request_id, row.start_position) == ("b", 4)
    assert row.token_ids == [54, 55, 56, 57, 58, TOKEN]
    run_to_completion(sched)
    assert len(b.output_token_ids) == 3 and blocks.num_free_blocks == 5


def test_num_cached_tokens_never_exceeds_the_prompt_after_a_resume() -> None:
    sched, _ = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=True, max_model_len=64)
    a = make_request("a", prompt_len=4, max_tokens=12)
    b = make_request("b", prompt=[50, 51], max_tokens=12)
    sched.add(a)
    sched.add(b)
    plans = run_to_completion(sched)
    assert any("b" in p.preempted_ids for p in plans)
    assert b.num_cached_tokens <= b.num_prompt_tokens


def test_a_scored_prompt_is_computed_in_full_in_short_chunks_with_logits_at_each_position() -> None:
    """prompt_logprobs: no prefix cache hit (a cached token has no logits), chunks of at most
    MAX_SCORED_CHUNK, and each row names the positions whose logits score the next prompt token."""
    from dataclasses import replace

    from conveyor.core.request import MAX_SCORED_CHUNK

    num_tokens = MAX_SCORED_CHUNK + 40
    sched, blocks = make_scheduler(num_blocks=256, block_size=4, max_num_batched_tokens=1024, max_model_len=1024,
                                   enable_prefix_caching=True)
    prompt = list(range(10, 10 + num_tokens))
    sched.add(make_request("warm", prompt=prompt, max_tokens=1))
    run_to_completion(sched)
    scored = make_request("scored", prompt=prompt, max_tokens=2)
    scored.params = replace(scored.params, prompt_logprobs=1)
    plain = make_request("plain", prompt=prompt, max_tokens=2)
    sched.add(scored)
    sched.add(plain)
    first, _ = step(sched)
    rows = {row.request_id: row for row in first.rows}
    assert rows["scored"].start_position == 0 and rows["scored"].num_tokens == MAX_SCORED_CHUNK
    assert rows["scored"].num_prompt_logits == MAX_SCORED_CHUNK and not rows["scored"].is_sampling
    assert rows["plain"].start_position > 0 and rows["plain"].num_prompt_logits == 0   # a cache hit
    second, _ = step(sched)
    [row] = [r for r in second.rows if r.request_id == "scored"]
    assert row.start_position == MAX_SCORED_CHUNK and row.is_sampling
    assert row.num_prompt_logits == num_tokens - 1 - MAX_SCORED_CHUNK   # the last position's logits are sampled
    third, _ = step(sched)
    assert all(r.num_prompt_logits == 0 for r in third.rows)   # decoding: the prompt is scored
    assert scored.num_cached_tokens == 0 and blocks.num_hit_tokens > 0
