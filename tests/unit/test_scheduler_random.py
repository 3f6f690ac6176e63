"""Random add / schedule / update / abort sequences against a small block pool (so preemption and
prefix-cache eviction happen), with the bookkeeping audited after every call.

A shadow KV cache records which token each step wrote into which slot; every row must find its
already-computed tokens (its own or a shared cached prefix) in the slots its block table names.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from helpers import EOS, FakeClock, audit_blocks, make_request
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.plan import StepPlan
from conveyor.core.request import FinishReason, Request, RequestStatus
from conveyor.core.scheduler import Scheduler
from conveyor.core.step_cost import StepCost, StepCostModel
from conveyor.front.admission import check_request
from conveyor.engine.messages import CoreInfo
from conveyor.errors import InvalidRequest
from conveyor.sampling_params import SamplingParams

STOP_TOKEN = 9
SHARED_PREFIXES = [[10 + k] * 3 + [20 + k, 21 + k, 22 + k] * 5 for k in range(3)]   # 18 tokens each
MAX_DRAIN_STEPS = 5000

configs = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4]),
    "num_blocks": st.integers(2, 10),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.integers(1, 24),
    "max_model_len": st.integers(4, 40),
    "enable_prefix_caching": st.booleans(),
    "target_itl_ms": st.sampled_from([None, None, 1.0, 30.0]),   # against COST: cut chunks, or none
    "min_prefill_chunk": st.integers(1, 4),
    "max_running_per_tenant": st.sampled_from([None, None, 1, 2]),
    "max_priority_preemptions": st.integers(0, 3),
})
COST = StepCost(fixed_s=0.01, per_token_s=0.001, per_context_token_s=1e-5)
seeds = st.integers(0, 2**16)
# The last field: 0 leaves the lengths as drawn (often refused by admission), else they are fitted
# to what the pool and max_model_len can hold.
add_ops = st.tuples(st.just("add"), st.integers(1, 24), st.one_of(st.none(), st.integers(1, 12)),
                    st.integers(0, 3), st.integers(0, 3), st.integers(0, 2), st.booleans(), seeds,
                    st.integers(0, 7))
step_ops = st.tuples(st.just("step"), seeds)
abort_ops = st.tuples(st.just("abort"), st.integers(0, 64))
abort_mid_step_ops = st.tuples(st.just("abort_mid_step"), st.integers(0, 64), seeds)
finish_ops = st.tuples(st.just("finish"), st.integers(0, 64))
ops = st.lists(st.one_of(add_ops, add_ops, add_ops, step_ops, step_ops, step_ops, step_ops, step_ops,
                         abort_ops, abort_mid_step_ops, finish_ops), min_size=20, max_size=80)


@dataclass
class Harness:
    sched: Scheduler
    blocks: BlockManager
    added: list[Request] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)   # every token fed to each request
    finished_since_plan: list[str] = field(default_factory=list)
    reported_finished: list[str] = field(default_factory=list)
    kv: dict[int, int] = field(default_factory=dict)              # slot -> token written there
    disk: dict[bytes, list[int]] | None = None                     # a second tier: block hash -> its tokens' KV

    # ------------------------------------------------------------ operations

    def add(self, index: int, prompt_len: int, max_tokens: int | None, priority: int, prefix_kind: int,
            min_tokens: int, ignore_eos: bool, seed: int, fit: int) -> None:
        sched, blocks = self.sched, self.blocks
        if fit:
            capacity = min(sched.max_model_len, blocks.num_blocks * blocks.block_size)
            prompt_len = 1 + (prompt_len - 1) % max(capacity - 1, 1)
            if max_tokens is not None:
                max_tokens = 1 + (max_tokens - 1) % max(capacity - prompt_len, 1)
            elif sched.max_model_len > capacity:
                max_tokens = capacity - prompt_len
        rng = random.Random(seed)
        tail = [rng.randint(3, 8) for _ in range(prompt_len)]
        prompt = (tail if prefix_kind == 0 else SHARED_PREFIXES[prefix_kind - 1] + tail)[:prompt_len]
        # The front's admission decides whether it fits and resolves max_tokens; the scheduler trusts it.
        info = CoreInfo(vocab_size=1000, max_model_len=sched.max_model_len, num_kv_blocks=blocks.num_blocks,
                        block_size=blocks.block_size, startup_s=0.0)
        try:
            resolved = check_request(prompt, SamplingParams(max_tokens=max_tokens), info)
        except InvalidRequest:
            resolved = max_tokens if max_tokens is not None else sched.max_model_len - prompt_len
            assert (prompt_len == 0 or resolved < 1 or prompt_len + resolved > sched.max_model_len
                    or blocks.blocks_for(prompt_len + resolved) > blocks.num_blocks)
            return
        request = make_request(f"r{index}", prompt=prompt, max_tokens=resolved, min_tokens=min(min_tokens, resolved),
                               ignore_eos=ignore_eos, priority=priority, tenant="ABC"[seed % 3],
                               stop_token_ids=[STOP_TOKEN] if seed % 3 == 0 else [])
        sched.add(request)
        assert request.status is RequestStatus.WAITING
        assert request.num_prompt_tokens + request.max_tokens <= sched.max_model_len
        self.added.append(request)
        self.outputs[request.request_id] = []

    def restore(self, request: Request) -> None:
        """What the disk tier does for a waiting request: its blocks past the memory hits, read back."""
        blocks, size = self.blocks, self.blocks.block_size
        in_memory = blocks.find_cached_blocks(request)
        blocks.touch(in_memory)
        room = blocks.num_free_blocks - sum(1 for b in in_memory if blocks.ref_counts[b] == 0)
        for block_hash in request.block_hashes[len(in_memory):(request.num_tokens - 1) // size][:room]:
            block_id = blocks.adopt(block_hash) if block_hash in self.disk else None
            if block_id is None:
                break
            for j, token in enumerate(self.disk[block_hash]):
                self.kv[block_id * size + j] = token

    def pick(self, index: int) -> str:
        ids = [r.request_id for r in self.added] + ["unknown"]
        return ids[index % len(ids)]

    def abort(self, index: int) -> None:
        request_id = self.pick(index)
        was_live = request_id in self.sched.requests
        assert self.sched.abort(request_id) is was_live
        if was_live:
            self.finished_since_plan.append(request_id)
            request = self.request(request_id)
            assert request.finish_reason is FinishReason.ABORT and request.block_table == []

    def finish(self, index: int) -> None:
        request_id = self.pick(index)
        if request_id in self.sched.requests:
            self.finished_since_plan.append(request_id)
        self.sched.finish(request_id, FinishReason.STOP, "<stop>")

    def step(self, seed: int, abort_index: int | None = None) -> StepPlan:
        rng = random.Random(seed)
        had_work = self.sched.has_unfinished()
        ready = [r.request_id for r in self.sched.running if r.num_tokens - r.num_computed_tokens == 1]
        for request in self.sched.waiting if self.disk is not None else ():
            self.restore(request)
        plan = self.sched.schedule()
        self.check_plan(plan, had_work)
        # Decodes come first: each one runs unless it lost its blocks or the step's tokens ran out.
        if len(ready) <= self.sched.config.max_num_batched_tokens:
            assert set(ready) <= set(plan.num_scheduled_tokens) | set(plan.preempted_ids)
        self.audit()
        if abort_index is not None:
            self.abort(abort_index)
            self.audit()
        live_before = set(self.sched.requests)
        sampled = [self.sample(rng) for _ in plan.sampling_ids]
        result = self.sched.update(plan, [[t] for t in sampled])
        if self.disk is not None:   # the disk tier copies each newly cached block out
            size = self.blocks.block_size
            for block_hash, block_id in self.blocks.take_new_blocks():
                self.disk[block_hash] = [self.kv[block_id * size + j] for j in range(size)]
        fed = dict(zip(plan.sampling_ids, sampled))
        for request_id, token in fed.items():
            if request_id in live_before:
                self.outputs[request_id].append(token)
        assert [u.request_id for u in result.updates] == [rid for rid in plan.sampling_ids if rid in live_before]
        for update in result.updates:
            assert update.new_token_ids == [fed[update.request_id]]
            request = self.request(update.request_id)
            if update.finish_reason is not None:
                self.finished_since_plan.append(update.request_id)
                assert request.is_finished and request.finish_reason is update.finish_reason
                self.check_stop(request)
            else:
                assert request.status is RequestStatus.RUNNING
        self.audit()
        return plan

    @staticmethod
    def sample(rng: random.Random) -> int:
        roll = rng.random()
        return EOS if roll < 0.05 else STOP_TOKEN if roll < 0.08 else rng.randint(3, 8)

    # ------------------------------------------------------------ checks

    def request(self, request_id: str) -> Request:
        return next(r for r in self.added if r.request_id == request_id)

    def check_plan(self, plan: StepPlan, had_work: bool) -> None:
        sched, blocks, size = self.sched, self.blocks, self.blocks.block_size
        assert list(plan.finished_ids) == self.finished_since_plan
        self.reported_finished.extend(plan.finished_ids)
        self.finished_since_plan = []
        if had_work:
            assert not plan.is_empty, "live requests but nothing scheduled"
        assert sum(row.num_tokens for row in plan.rows) <= sched.config.max_num_batched_tokens
        assert len(plan.rows) <= sched.config.max_num_seqs
        assert sched.num_running <= sched.config.max_num_seqs
        row_ids = [row.request_id for row in plan.rows]
        assert len(set(row_ids)) == len(row_ids)
        assert not set(row_ids) & set(plan.preempted_ids)
        for request_id in plan.preempted_ids:
            request = sched.requests[request_id]
            assert request.status is RequestStatus.WAITING and request.block_table == []
            assert request.num_computed_tokens == 0
        for row in plan.rows:
            request = sched.requests[row.request_id]
            start, end = row.start_position, row.start_position + row.num_tokens
            assert request.status is RequestStatus.RUNNING
            assert row.num_tokens >= 1 and start == request.num_computed_tokens
            assert row.token_ids == request.all_token_ids[start:end]
            assert row.block_table == request.block_table and len(row.block_table) * size >= end
            assert row.is_sampling == (end == request.num_tokens)
            # Tokens already computed are in the cache where the block table says.
            for position in range(start):
                slot = row.block_table[position // size] * size + position % size
                assert self.kv.get(slot) == request.all_token_ids[position], \
                    f"{row.request_id} position {position}: cache holds {self.kv.get(slot)}"
            # Writes go to blocks nobody else can see: unpublished and held once.
            for position in range(start, end):
                block_id = row.block_table[position // size]
                assert blocks.block_hashes[block_id] is None and blocks.ref_counts[block_id] == 1
                self.kv[block_id * size + position % size] = request.all_token_ids[position]

    def check_stop(self, request: Request) -> None:
        out, params = request.output_token_ids, request.params
        if request.finish_reason is FinishReason.LENGTH:
            assert len(out) == request.max_tokens
        else:
            assert request.finish_reason is FinishReason.STOP and len(out) >= params.min_tokens
            if request.stop_reason is None:
                assert out[-1] == EOS and not params.ignore_eos
            else:
                assert request.stop_reason == out[-1] == STOP_TOKEN

    def audit(self) -> None:
        sched = self.sched
        live = list(sched.requests.values())
        audit_blocks(self.blocks, live)
        assert {r.request_id for r in sched.waiting} | {r.request_id for r in sched.running} == set(sched.requests)
        assert len(sched.waiting) + len(sched.running) == len(sched.requests)
        assert sched.waiting == sorted(sched.waiting, key=lambda r: r.sort_key)
        assert sched.running == sorted(sched.running, key=lambda r: r.sort_key)
        for request in sched.waiting:
            assert request.status is RequestStatus.WAITING and request.block_table == []
        for request in sched.running:
            assert request.status is RequestStatus.RUNNING
            assert len(request.block_table) * self.blocks.block_size >= request.num_computed_tokens
            assert request.num_computed_tokens < request.num_tokens
        for request in self.added:
            # Output tokens are never lost, by preemption or otherwise.
            assert request.output_token_ids == self.outputs[request.request_id]
            assert request.all_token_ids == request.prompt_token_ids + request.output_token_ids
            assert len(request.output_token_ids) <= request.max_tokens
            assert request.num_tokens <= sched.max_model_len
            if request.is_finished:
                assert request.block_table == [] and request.request_id not in sched.requests
        assert sched.num_preemptions == sum(r.num_preemptions for r in self.added)


def run(config: dict, operations: list[tuple], second_tier: bool = False) -> Harness:
    blocks = BlockManager(config["num_blocks"], config["block_size"], config["enable_prefix_caching"])
    scheduler_config = SchedulerConfig(max_num_seqs=config["max_num_seqs"],
                                       max_num_batched_tokens=config["max_num_batched_tokens"],
                                       target_itl_ms=config.get("target_itl_ms"),
                                       min_prefill_chunk=config.get("min_prefill_chunk", 1),
                                       max_running_per_tenant=config.get("max_running_per_tenant"),
                                       max_priority_preemptions=config.get("max_priority_preemptions", 3))
    cost_model = StepCostModel(prior=COST) if config.get("target_itl_ms") else None
    harness = Harness(Scheduler(scheduler_config, blocks, config["max_model_len"], FakeClock(), cost_model), blocks)
    if second_tier:
        blocks.track_new_blocks, harness.disk = True, {}
    for index, op in enumerate(operations):
        kind, *args = op
        if kind == "add":
            harness.add(index, *args)
        elif kind == "step":
            harness.step(*args)
        elif kind == "abort":
            harness.abort(*args)
        elif kind == "abort_mid_step":
            harness.step(args[1], abort_index=args[0])
        else:
            harness.finish(*args)
        harness.audit()

    # Drain: with no more adds or aborts, everything finishes in a bounded number of steps.
    for drain_step in range(MAX_DRAIN_STEPS):
        if not harness.sched.has_unfinished():
            break
        harness.step(seed=drain_step)
    assert not harness.sched.has_unfinished(), "requests never finished"
    harness.check_plan(harness.sched.schedule(), had_work=False)
    assert sorted(harness.reported_finished) == sorted(r.request_id for r in harness.added)
    assert all(r.is_finished and r.finish_reason is not None for r in harness.added)
    assert blocks.num_free_blocks == blocks.num_blocks
    audit_blocks(blocks, [])
    return harness


@settings(max_examples=200, deadline=None)
@given(config=configs, operations=ops)
def test_random_operations_keep_the_books_balanced(config: dict, operations: list[tuple]) -> None:
    run(config, operations)


@settings(max_examples=100, deadline=None)
@given(config=configs.filter(lambda c: c["enable_prefix_caching"]),
       operations=st.lists(st.one_of(add_ops.filter(lambda op: op[4] != 0), step_ops, step_ops), max_size=40))
def test_random_shared_prefixes_with_prefix_caching(config: dict, operations: list[tuple]) -> None:
    harness = run(config, operations)
    assert harness.blocks.num_query_tokens >= harness.blocks.num_hit_tokens >= 0


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_busy_random_workloads_with_a_second_tier(seed: int) -> None:
    """Blocks read back from a second tier before each step hold the tokens their hash names."""
    config, operations = busy_workload(seed)
    harness = run({**config, "enable_prefix_caching": True}, operations, second_tier=True)
    assert harness.blocks.num_adopted_hit_tokens <= harness.blocks.num_hit_tokens


def busy_workload(seed: int) -> tuple[dict, list[tuple]]:
    """A crowded pool: bursts of requests sharing prefixes, many steps, few aborts."""
    rng = random.Random(seed)
    config = {"block_size": rng.choice([2, 4]), "num_blocks": rng.randint(4, 12),
              "max_num_seqs": rng.randint(2, 8), "max_num_batched_tokens": rng.randint(4, 32),
              "max_model_len": 48,
              "enable_prefix_caching": rng.random() < 0.7,
              "target_itl_ms": rng.choice([None, 1.0, 30.0]), "min_prefill_chunk": rng.randint(1, 4)}
    operations: list[tuple] = []
    for _ in range(rng.randint(20, 60)):
        roll = rng.random()
        if roll < 0.3:
            operations.append(("add", rng.randint(1, 20), rng.choice([None, rng.randint(1, 16)]),
                               rng.randint(0, 2), rng.randint(0, 3), rng.randint(0, 2), rng.random() < 0.5,
                               rng.randint(0, 2**16), 1))
        elif roll < 0.9:
            operations.append(("step", rng.randint(0, 2**16)))
        elif roll < 0.95:
            operations.append(("abort_mid_step", rng.randint(0, 64), rng.randint(0, 2**16)))
        else:
            operations.append(("abort", rng.randint(0, 64)))
    return config, operations


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
@example(seed=2891000577)   # a short chunk that cannot make room must not stop a longer one that can
def test_busy_random_workloads(seed: int) -> None:
    run(*busy_workload(seed))
