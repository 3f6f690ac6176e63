"""Speculative decoding without a model: the n-gram proposer, and the scheduler's draft slots
(granted, verified, rolled back, stopped inside an accepted run)."""

from __future__ import annotations

import random

import pytest
from helpers import EOS, FakeClock, audit_blocks, make_request

from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.request import FinishReason
from conveyor.core.scheduler import EXPLORE_EVERY, Scheduler
from conveyor.core.speculative import NgramProposer, worth_drafting
from conveyor.core.step_cost import StepCost, StepCostModel

# ------------------------------------------------------------ proposer


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == tail:
                return tokens[end:end + k]
    return []


def test_longest_ngram_and_its_latest_occurrence_win() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert proposer.propose("a", tokens, 4) == [7, 5, 1, 2]
    assert proposer.propose("b", [5, 6, 7, 8, 6, 7], 3) == [8, 6, 7]    # no 3-gram match: the 2-gram's
    assert proposer.propose("c", [1, 2, 3, 4], 3) == []                 # nothing repeats
    assert NgramProposer(min_n=3, max_n=3).propose("d", [5, 6, 7, 8, 6, 7], 3) == []


def test_incremental_index_matches_a_fresh_search() -> None:
    rng = random.Random(0)
    for trial in range(30):
        proposer = NgramProposer(min_n=1 + trial % 2, max_n=2 + trial % 3)
        tokens = [rng.randrange(5) for _ in range(4)]
        for _ in range(60):
            k = rng.randrange(1, 6)
            assert proposer.propose("r", tokens, k) == brute_force(tokens, k, proposer.min_n, proposer.max_n)
            tokens += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
        proposer.forget("r")
        assert proposer.propose("r", tokens[:5], 3) == brute_force(tokens[:5], 3, proposer.min_n, proposer.max_n)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def test_worth_drafting_weighs_acceptance_against_cost() -> None:
    assert worth_drafting(0.5, token_cost_s=0.001, step_s=0.02, tokens_per_step=1)       # small batch: cheap
    assert not worth_drafting(0.5, token_cost_s=0.0015, step_s=0.15, tokens_per_step=64)  # at the knee: not


# ------------------------------------------------------------ scheduler

PROMPT = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]   # "10 11" is followed by "12 13 10 11" earlier


def make_scheduler(num_blocks: int = 32, k: int = 4, cost_model: StepCostModel | None = None,
                   prefix_caching: bool = False) -> tuple[Scheduler, BlockManager]:
    blocks = BlockManager(num_blocks, 4, prefix_caching)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    return Scheduler(config, blocks, 256, FakeClock(), cost_model, NgramProposer(1, 4), k), blocks


def speculating(request_id: str, prompt=PROMPT, **kwargs):
    request = make_request(request_id, prompt=prompt, **kwargs)
    request.can_speculate = True
    return request


def prefill(sched: Scheduler, first_token: int = 12) -> None:
    plan = sched.schedule()
    assert all(row.num_draft_tokens == 0 for row in plan.rows)
    sched.update(plan, [[first_token]] * len(plan.sampling_ids))


def test_decode_row_carries_drafts_and_keeps_the_accepted_run() -> None:
    sched, blocks = make_scheduler()
    request = speculating("a", max_tokens=20)
    sched.add(request)
    prefill(sched)                                   # context ... 10 11 | 12
    plan = sched.schedule()
    (row,) = plan.rows
    assert row.token_ids == [12, 13, 10, 11, 12] and row.num_draft_tokens == 4 and row.num_logits == 5
    assert row.draft_token_ids == [13, 10, 11, 12] and len(row.block_table) == blocks.blocks_for(15)
    result = sched.update(plan, [[13, 10, 99]])      # two drafts agreed, then the model's own token
    (update,) = result.updates
    assert update.new_token_ids == [13, 10, 99]
    assert (update.num_draft_tokens, update.num_accepted_tokens) == (4, 2)
    assert request.output_token_ids == [12, 13, 10, 99]
    assert request.num_computed_tokens == 13 == request.num_tokens - 1
    assert len(request.block_table) == blocks.blocks_for(13)    # the rejected drafts' block went back
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (4, 2)
    audit_blocks(blocks, [request])


def test_all_drafts_accepted_gives_the_bonus_token() -> None:
    sched, blocks = make_scheduler()
    request = speculating("a", max_tokens=20)
    sched.add(request)
    prefill(sched)
    plan = sched.schedule()
    sched.update(plan, [[13, 10, 11, 12, 77]])
    assert request.output_token_ids == [12, 13, 10, 11, 12, 77]
    assert request.num_computed_tokens == 15 and len(request.block_table) == blocks.blocks_for(15)
    audit_blocks(blocks, [request])


def test_emitted_tokens_must_start_with_the_drafts() -> None:
    sched, _ = make_scheduler()
    sched.add(speculating("a", max_tokens=20))
    prefill(sched)
    plan = sched.schedule()
    with pytest.raises(ValueError):
        sched.update(plan, [[14, 10]])               # 14 is not the first draft, so nothing may follow it
    with pytest.raises(ValueError):
        sched.update(plan, [[13, 10, 11, 12, 5, 6]])  # more than drafts + 1


def test_a_stop_inside_the_accepted_run_ends_it_there() -> None:
    sched, blocks = make_scheduler()
    request = speculating("a", max_tokens=20, stop_token_ids=[10])
    sched.add(request)
    prefill(sched)
    plan = sched.schedule()
    (update,) = sched.update(plan, [[13, 10, 11]]).updates
    assert update.new_token_ids == [13, 10] and update.finish_reason is FinishReason.STOP
    assert request.output_token_ids == [12, 13, 10] and update.stop_reason == 10
    assert blocks.num_used_blocks == 0


def test_drafts_never_pass_max_tokens_or_the_model_length() -> None:
    sched, _ = make_scheduler()
    request = speculating("a", max_tokens=3)
    sched.add(request)
    prefill(sched)                                   # 1 of 3 out: this step may emit 2, so 1 draft
    plan = sched.schedule()
    assert plan.rows[0].num_draft_tokens == 1
    (update,) = sched.update(plan, [[13, 10]]).updates
    assert update.finish_reason is FinishReason.LENGTH and request.output_token_ids == [12, 13, 10]


def test_only_speculating_requests_get_drafts_and_eos_stops_the_run() -> None:
    sched, blocks = make_scheduler()
    plain = make_request("plain", prompt=PROMPT, max_tokens=20)
    spec = speculating("spec", max_tokens=20)
    sched.add(plain)
    sched.add(spec)
    prefill(sched)
    plan = sched.schedule()
    assert [row.num_draft_tokens for row in plan.rows] == [0, 4]
    result = sched.update(plan, [[13], [13, 10, EOS]])
    assert [u.new_token_ids for u in result.updates] == [[13], [13, 10, EOS]]
    assert result.updates[1].finish_reason is FinishReason.STOP
    audit_blocks(blocks, [plain])


def test_no_request_is_preempted_for_a_guess() -> None:
    sched, blocks = make_scheduler(num_blocks=4)   # 16 slots: a's 10 tokens take 3 blocks, b's 2 the 4th
    request = speculating("a", max_tokens=6)
    other = make_request("b", prompt=[1, 2], max_tokens=2)
    sched.add(request)
    sched.add(other)
    prefill(sched)
    plan = sched.schedule()
    assert plan.preempted_ids == () and blocks.num_free_blocks == 0
    assert plan.rows[0].num_draft_tokens == 1       # only slot 11, the last of a's 3rd block, was free
    audit_blocks(blocks, [request, other])


def test_the_cost_model_turns_drafts_off_near_the_compute_knee() -> None:
    cheap = StepCostModel(prior=StepCost(fixed_s=0.02, per_token_s=0.0005, per_context_token_s=0.0))
    sched, _ = make_scheduler(cost_model=cheap)
    sched.add(speculating("a", max_tokens=20))
    prefill(sched)
    assert sched.schedule().rows[0].num_draft_tokens > 0
    dear = StepCostModel(prior=StepCost(fixed_s=0.001, per_token_s=0.01, per_context_token_s=0.0))
    sched, _ = make_scheduler(cost_model=dear)
    request = speculating("a", max_tokens=20)
    sched.add(request)
    prefill(sched)
    sched.draft_acceptance = 0.9                      # guesses have been earning more lately
    before = request.draft_acceptance
    assert sched.schedule().rows[0].num_draft_tokens == 0
    assert before < request.draft_acceptance < 0.9    # refused: trust creeps towards that, for a later try


def test_a_refused_request_still_tries_one_guess_now_and_then() -> None:
    """With every guess refused by the cost model, one is tried every EXPLORE_EVERY decodes, so a draft
    that starts to agree is found again; a useless one costs a guess in that many steps."""
    dear = StepCostModel(prior=StepCost(fixed_s=0.001, per_token_s=0.01, per_context_token_s=0.0))
    sched, _ = make_scheduler(num_blocks=64, cost_model=dear)
    sched.add(speculating("a", max_tokens=2 * EXPLORE_EVERY + 8))
    prefill(sched)
    granted = []
    for _ in range(2 * EXPLORE_EVERY):
        plan = sched.schedule()
        granted.append(plan.rows[0].num_draft_tokens)
        sched.update(plan, [[7]])                     # never the guess
    assert sum(granted) == 2 and granted[EXPLORE_EVERY - 1] == 1 and granted[2 * EXPLORE_EVERY - 1] == 1


class FixedGuess:
    """A proposer that always guesses the same tokens, to drive acceptance by hand."""

    cost_per_token_s = 0.0

    def propose(self, request_id, token_ids, max_tokens):
        return [1, 2, 3, 4][:max_tokens]

    def propose_many(self, asks):
        return [self.propose(*ask) for ask in asks]

    def forget(self, request_id):
        pass


def test_rejections_lower_acceptance_and_with_it_the_drafts() -> None:
    cost = StepCostModel(prior=StepCost(fixed_s=0.02, per_token_s=0.002, per_context_token_s=0.0))
    blocks = BlockManager(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), blocks, 256, FakeClock(),
                      cost, FixedGuess(), 4)
    request = speculating("a", max_tokens=60)
    sched.add(request)
    prefill(sched)
    granted = []
    for _ in range(8):
        plan = sched.schedule()
        granted.append(plan.rows[0].num_draft_tokens)
        sched.update(plan, [[9]])                     # every guess rejected
        audit_blocks(blocks, [request])
    assert granted[0] == 2 and granted[-1] < granted[0] and request.draft_acceptance < 0.2
    assert request.num_accepted_tokens == 0 and request.num_draft_tokens == sum(granted)


def test_prefix_cache_publishes_only_verified_blocks() -> None:
    sched, blocks = make_scheduler(prefix_caching=True)
    request = speculating("a", prompt=PROMPT[:7], max_tokens=20)   # 7 prompt tokens, blocks of 4
    sched.add(request)
    prefill(sched, first_token=13)                   # context 10 11 12 13 10 11 12 | 13
    plan = sched.schedule()
    assert plan.rows[0].num_draft_tokens >= 2
    sched.update(plan, [[50]])                       # nothing accepted: only the 8 verified tokens count
    assert request.num_computed_tokens == 8
    assert len(blocks.cached) == 2                   # blocks 0-3 and 4-7, both fully verified
    audit_blocks(blocks, [request])
