"""BatchSnapshot without a model: row states through a request's life, the block map, and when one is due."""

from __future__ import annotations

from helpers import FakeClock, make_request

from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.scheduler import Scheduler
from conveyor.core.snapshot import MAX_WAITING_ROWS, BlockState, RowState, SnapshotSchedule, take_snapshot

TOKEN = 7


def make(num_blocks: int = 16, max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
         enable_prefix_caching: bool = False) -> tuple[Scheduler, BlockManager]:
    blocks = BlockManager(num_blocks, 4, enable_prefix_caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             target_itl_ms=None)
    return Scheduler(config, blocks, 256, FakeClock()), blocks


def step(sched: Scheduler) -> None:
    plan = sched.schedule()
    sched.update(plan, [[TOKEN] for _ in plan.sampling_ids])


def snap(sched: Scheduler, blocks: BlockManager, now_s: float = 0.0):
    return take_snapshot(now_s, sched.running, sched.waiting, blocks)


def states(sched: Scheduler, blocks: BlockManager) -> dict[str, RowState]:
    return {row.request_id: row.state for row in snap(sched, blocks).rows}


def test_a_request_goes_waiting_prefilling_decoding_and_leaves() -> None:
    sched, blocks = make(max_num_batched_tokens=8)
    sched.add(make_request("a", prompt_len=12, max_tokens=3))
    assert states(sched, blocks) == {"a": RowState.WAITING}
    step(sched)   # 8 of 12 prompt tokens
    [row] = snap(sched, blocks).rows
    assert (row.state, row.num_computed_prompt_tokens, row.num_prompt_tokens, row.num_output_tokens) == \
        (RowState.PREFILLING, 8, 12, 0)
    assert row.num_blocks == 2
    step(sched)   # the last 4, and the first token
    [row] = snap(sched, blocks).rows
    assert (row.state, row.num_computed_prompt_tokens, row.num_output_tokens) == (RowState.DECODING, 12, 1)
    step(sched)
    step(sched)   # max_tokens 3: finished
    snapshot = snap(sched, blocks)
    assert snapshot.rows == () and snapshot.num_running == snapshot.num_waiting == 0
    assert set(snapshot.block_states) == {BlockState.FREE}


def test_a_preempted_request_is_shown_as_preempted_with_its_tokens() -> None:
    sched, blocks = make(num_blocks=4)
    sched.add(make_request("a", prompt_len=8, max_tokens=8))
    sched.add(make_request("b", prompt_len=7, max_tokens=8))
    step(sched)
    step(sched)   # a's 9th token needs a third block: b is preempted
    rows = {row.request_id: row for row in snap(sched, blocks).rows}
    assert rows["a"].state is RowState.DECODING
    assert rows["b"].state is RowState.PREEMPTED and rows["b"].num_preemptions == 1
    assert rows["b"].num_output_tokens == 1 and rows["b"].num_computed_prompt_tokens == 0


def test_running_rows_come_first_then_a_capped_list_of_waiting_ones() -> None:
    sched, blocks = make(num_blocks=64, max_num_seqs=2)
    for i in range(MAX_WAITING_ROWS + 10):
        sched.add(make_request(f"r{i}", prompt_len=4))
    step(sched)
    snapshot = snap(sched, blocks)
    assert [row.request_id for row in snapshot.rows[:2]] == ["r0", "r1"]
    assert len(snapshot.rows) == 2 + MAX_WAITING_ROWS
    assert snapshot.num_running == 2 and snapshot.num_waiting == MAX_WAITING_ROWS + 8
    assert all(row.state is RowState.WAITING for row in snapshot.rows[2:])


def test_requests_outside_the_scheduler_are_listed_as_waiting() -> None:
    sched, blocks = make()
    compiling = make_request("grammar", prompt_len=4)
    snapshot = take_snapshot(0.0, sched.running, sched.waiting, blocks, [compiling])
    assert [(row.request_id, row.state) for row in snapshot.rows] == [("grammar", RowState.WAITING)]
    assert snapshot.num_waiting == 1


def test_block_map_tells_free_in_use_cached_and_shared_blocks_apart() -> None:
    sched, blocks = make(num_blocks=8, enable_prefix_caching=True)
    sched.add(make_request("a", prompt=list(range(100, 109)), max_tokens=1))   # 2 full blocks + 1
    step(sched)   # a finishes at once: its full blocks stay cached, free
    states = snap(sched, blocks).block_states
    assert states.count(BlockState.CACHED) == 2 and states.count(BlockState.IN_USE) == 0
    sched.add(make_request("b", prompt=list(range(100, 109)), max_tokens=4))
    step(sched)   # b reuses both cached blocks
    snapshot = snap(sched, blocks)
    assert snapshot.block_states.count(BlockState.IN_USE_CACHED) == 2
    assert snapshot.block_states.count(BlockState.IN_USE) == 1
    assert snapshot.block_states.count(BlockState.FREE) == 5
    assert snapshot.rows[0].num_cached_tokens == 8
    assert (snapshot.num_prefix_query_tokens, snapshot.num_prefix_hit_tokens) == (18, 8)   # 9 prompt tokens each


def test_schedule_is_off_until_watched_then_throttled_but_never_skips_the_idle_state() -> None:
    schedule = SnapshotSchedule()
    assert not schedule.is_due(0.0, is_idle=True)
    schedule.watch(0.25)
    assert schedule.is_due(10.0, is_idle=False)          # a new viewer: at once
    assert not schedule.is_due(10.1, is_idle=False)
    assert schedule.is_due(10.1, is_idle=True)           # the core goes idle: the last state goes out
    assert not schedule.is_due(10.3, is_idle=False)
    assert schedule.is_due(10.36, is_idle=False)
    schedule.watch(0.25)
    assert schedule.is_due(10.37, is_idle=False)         # another viewer: at once again
    schedule.watch(None)
    assert not schedule.is_due(20.0, is_idle=True)


def test_rows_show_what_the_last_step_computed_for_them_or_why_they_wait() -> None:
    sched, blocks = make(num_blocks=64, max_num_seqs=2)
    for request_id, prompt_len in (("a", 200), ("b", 4), ("c", 4)):
        sched.add(make_request(request_id, prompt_len=prompt_len, max_tokens=3))
    step(sched)   # a's first chunk takes the whole budget
    step(sched)   # b goes ahead of a's next chunk; c finds no seat left
    rows = {row.request_id: row for row in
            take_snapshot(0.0, sched.running, sched.waiting, blocks, served=sched.last_served).rows}
    assert (rows["a"].num_step_tokens, rows["b"].num_step_tokens, rows["c"].num_step_tokens) == (60, 4, 0)
    assert (rows["a"].wait_cause, rows["b"].wait_cause, rows["c"].wait_cause) == (None, None, "budget")
