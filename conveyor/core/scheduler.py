"""Scheduler: every step, decide which requests compute which tokens, under the step's budgets.

Pure Python (no torch, no threads, no clock of its own). Each step every request's
`num_computed_tokens` catches up towards `num_tokens`: a decode is a one-token catch-up, a prompt
chunk a longer one, a resumed (preempted) request a recompute of everything it had. One code path
covers chunked prefill, decode and resume.

    running (priority order)         waiting (priority order)
    [r0 r1 ... rk]  --decode/chunk-->  step  <--admit while budgets and blocks allow-- [w0 w1 ...]
         ^  preempt the last running when blocks run out: it returns to waiting, tokens kept

Within a priority level, new requests are admitted in turns between tenants (fairness.py), FCFS within
a tenant. A waiting request with a better priority than a running one takes its place when the batch
or the KV cache is full: the running one is preempted (tokens kept), at most max_priority_preemptions times.

A step takes every decode first, then prompts (prompt_phase.py): chunks of prompts already started,
with waiting prompts shorter than a started one admitted ahead of its chunk, then new prompts; so a
long prompt never holds back a stream, nor a short prompt that arrives while it is computed. With a
cost model and a target inter-token latency, the prompt tokens of a step that decodes are cut to
what fits in the target (`PrefillBudget`).

With a proposer (speculative decoding), a decode may carry draft tokens after its one new token: the step
computes them all and samples at each; `update` keeps the leading drafts the model agreed with and gives
back the KV slots of the rest. Drafts are granted after the decodes and before any prompt chunk, only
while the cost model says they raise the step's rate of emitted tokens.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Sequence

from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.fairness import TenantShares
from conveyor.core.plan import RequestUpdate, ScheduledRow, StepPlan, StepResult
from conveyor.core.prompt_phase import PromptPhase
from conveyor.core.request import FinishReason, Request, RequestStatus
from conveyor.core.speculative import Proposer, worth_drafting
from conveyor.core.step_cost import StepCostModel, StepShape
from conveyor.errors import InvalidRequest


EXPLORE_EVERY = 32   # decodes refused a guess before one is tried anyway
CREEP_TARGET = 0.75  # what a refused request's trust creeps towards, at the least


class Scheduler(PromptPhase):
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic, cost_model: StepCostModel | None = None,
                 proposer: Proposer | None = None, num_speculative_tokens: int = 0) -> None:
        self.config = config
        self.cost_model = cost_model   # None: steps are sized by max_num_batched_tokens alone
        self.proposer = proposer       # None: no speculative decoding
        self.draft_acceptance = 0.5    # recent share of guesses accepted, over every request
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []     # sorted by sort_key
        self.running: list[Request] = []     # sorted by sort_key
        self._finished_ids: list[str] = []   # since the last plan
        self._wait_causes: dict[str, str] = {}
        self.last_served: dict[str, int] = {}   # request id -> tokens the last plan computed for it
        self._line_cause = "budget"
        self._arrivals = 0
        self.num_preemptions = 0
        self.shares = TenantShares(dict(config.tenant_weights))

    # ------------------------------------------------------------ requests in and out

    def add(self, request: Request) -> None:
        """Queue an admitted request: the front's admission (front/admission.py) already decided that
        it fits, its max_tokens resolved. Raises InvalidRequest for a duplicate id."""
        if request.request_id in self.requests:
            raise InvalidRequest(f"duplicate request id {request.request_id!r}")
        # Admission's promise, relied on by every plan: the whole request fits the model length and the pool.
        assert 1 <= request.max_tokens <= self.max_model_len - request.num_prompt_tokens, request.request_id
        assert self.blocks.blocks_for(request.num_prompt_tokens + request.max_tokens) <= self.blocks.num_blocks
        request.arrival_index = self._arrivals
        self._arrivals += 1
        request.status = RequestStatus.WAITING
        request.draft_acceptance = self.draft_acceptance   # a new request starts from what guesses earn lately
        self.requests[request.request_id] = request
        self.shares.join(request.tenant)
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def abort(self, request_id: str) -> bool:
        """Finish a request in any state and free its blocks now. False if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORT)
        return True

    def finish(self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End a request from outside (a stop string found by the detokenizer, a failed step)."""
        request = self.requests.get(request_id)
        if request is not None:
            request.stop_reason = stop_reason
            self._finish(request, reason)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------ one step

    def schedule(self) -> StepPlan:
        self._charge_queue_time(self.clock())
        self._wait_causes, self._line_cause = {}, "budget"
        budget = self.config.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preempted: list[str] = []
        scheduled: set[str] = set()
        self._preempt_for_priority(preempted)
        num_priority_preempted = len(preempted)

        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        for request in decodes:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted for a higher-priority decode in this loop
            if not self._make_room(request, request.num_computed_tokens + 1, scheduled, preempted):
                self._preempt(request)
                preempted.append(request.request_id)
                continue
            self._schedule_running(request, 1, rows, scheduled)
            budget -= 1

        if self.num_speculative_tokens and rows:
            budget = self._add_drafts(rows, budget)

        self._schedule_prompts(rows, scheduled, preempted, num_priority_preempted, budget)
        return self._plan(rows, preempted)

    def update(self, plan: StepPlan, sampled: Iterable[Sequence[int]]) -> StepResult:
        """Advance the scheduled requests; `sampled` holds, per sampling row in plan order, the tokens
        it emits: the leading drafts the model agreed with, then the model's own next token."""
        emitted_rows = [list(tokens) for tokens in sampled]
        sampling_rows = [row for row in plan.rows if row.is_sampling]
        if len(emitted_rows) != len(sampling_rows):
            raise ValueError(f"{len(emitted_rows)} sampled rows for {len(sampling_rows)} sampling rows")
        for row, emitted in zip(sampling_rows, emitted_rows):
            accepted = len(emitted) - 1
            if accepted == 0:
                continue   # one token, no draft taken: nothing to check (the common row, kept cheap)
            if not 0 <= accepted <= row.num_draft_tokens or emitted[:accepted] != row.draft_token_ids[:accepted]:
                raise ValueError(f"row {row.request_id}: {emitted} does not start with accepted drafts of "
                                 f"{row.draft_token_ids}")
        emitted_iter = iter(emitted_rows)
        result = StepResult()
        now = self.clock()
        for row in plan.rows:
            emitted = next(emitted_iter) if row.is_sampling else None
            request = self.requests.get(row.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            drafts = row.num_draft_tokens
            accepted = len(emitted) - 1 if emitted is not None else 0
            # The KV of rejected drafts is left behind the computed tokens, where nothing reads it.
            request.num_computed_tokens = row.start_position + row.num_tokens - drafts + accepted
            if drafts:
                self.blocks.truncate(request, request.num_computed_tokens)
                request.num_draft_tokens += drafts
                request.num_accepted_tokens += accepted
                request.draft_acceptance = 0.75 * request.draft_acceptance + 0.25 * accepted / drafts
                self.draft_acceptance = 0.9 * self.draft_acceptance + 0.1 * accepted / drafts
            if emitted is None:
                self.blocks.cache_full_blocks(request)
                continue
            update = RequestUpdate(row.request_id, [], num_draft_tokens=drafts, num_accepted_tokens=accepted)
            reason = None
            for token in emitted:   # nothing after a stop is emitted
                request.append_token(token)
                update.new_token_ids.append(token)
                reason, stop_reason = self._check_stop(request, token)
                if reason is not None:
                    break
            self.shares.charge(request.tenant, output_tokens=len(update.new_token_ids))
            if request.first_token_s is None:
                request.first_token_s = now
            request.last_token_s = now
            # A stop inside the accepted run leaves computed drafts past the kept tokens: they never count.
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            self.blocks.cache_full_blocks(request)   # before a finish frees them, so they stay cached
            if reason is not None:
                update.finish_reason, update.stop_reason = reason, stop_reason
                request.stop_reason = stop_reason
                self._finish(request, reason)
            result.updates.append(update)
        return result

    # ------------------------------------------------------------ internals

    def _plan(self, rows: list[ScheduledRow], preempted: list[str]) -> StepPlan:
        self._note_wait_causes(rows)
        self.last_served = {row.request_id: row.num_tokens for row in rows}
        finished, self._finished_ids = self._finished_ids, []
        return StepPlan(rows=tuple(rows), preempted_ids=tuple(preempted), finished_ids=tuple(finished))

    def _add_drafts(self, rows: list[ScheduledRow], budget: int) -> int:
        """Extend the step's decode rows with draft tokens; returns the token budget left.

        The j-th draft of a request is accepted with probability about acceptance**j (every earlier
        one must be too); it is granted while that raises the step's expected tokens per second, by
        the cost model. The proposer is asked once for every row's guesses (a draft model guesses
        for all rows in the same forwards, so its cost per guess is shared by the rows that guess).
        No request is preempted for a guess; its slots come from free blocks (empty ones first, as
        the free queue keeps them in front of cached prefixes).
        """
        cost = self.cost_model.cost if self.cost_model is not None else None
        shape = StepShape.from_rows(rows)
        step_s = cost.predict_s(shape.num_tokens, shape.num_context_tokens, shape.num_sampling_rows) \
            if cost is not None else 0.0
        expected_tokens = float(len(rows))
        eligible = [i for i, row in enumerate(rows)
                    if self.requests[row.request_id].can_speculate and not row.is_prefill]
        drafting_s = self.proposer.cost_per_token_s / max(1, len(eligible))
        wanted: list[tuple[int, Request, int]] = []   # row index, request, guesses that pay
        for i in eligible:
            row, request = rows[i], self.requests[rows[i].request_id]
            cap = min(self.num_speculative_tokens, budget, request.max_tokens - len(request.output_token_ids) - 1,
                      self.max_model_len - request.num_tokens - 1,
                      self.blocks.capacity(request) - row.start_position - 1)
            want = 0
            while want < cap:
                if cost is not None:
                    chance = request.draft_acceptance ** (want + 1)
                    # A guess is a sampled row too: it pays for the output layer as well, and for its drafting.
                    token_s = cost.chunk_s(row.start_position + 1 + want, 1) + cost.per_sampling_row_s + drafting_s
                    if not worth_drafting(chance, token_s, step_s, expected_tokens):
                        break
                    step_s += token_s
                    expected_tokens += chance
                want += 1
            if cap > 0 and want == 0:
                # Refused for a poor record: its trust creeps back (towards what guesses earn lately, or a
                # hopeful CREEP_TARGET when that is lower), and every so often one guess is tried anyway,
                # so a request or a draft that starts to agree is found again.
                target = max(self.draft_acceptance, CREEP_TARGET)
                request.draft_acceptance += 0.02 * (target - request.draft_acceptance)
                request.steps_without_drafts += 1
                if request.steps_without_drafts >= EXPLORE_EVERY:
                    want = 1
            if want:
                request.steps_without_drafts = 0
                wanted.append((i, request, want))
                budget -= want   # held for its guesses; what the proposer does not guess comes back
        if not wanted:
            return budget
        proposals = self.proposer.propose_many([(request.request_id, request.all_token_ids, want)
                                                for _, request, want in wanted])
        for (i, request, want), drafts in zip(wanted, proposals):
            granted = min(len(drafts), want)
            budget += want - granted
            if granted <= 0:
                continue
            row = rows[i]
            self.blocks.allocate(request, row.start_position + 1 + granted)
            rows[i] = ScheduledRow(request_id=row.request_id, token_ids=row.token_ids + drafts[:granted],
                                   start_position=row.start_position, block_table=list(request.block_table),
                                   is_sampling=True, is_prefill=False, num_draft_tokens=granted)
        return budget

    def _make_room(self, request: Request, num_tokens: int, scheduled: set[str], preempted: list[str]) -> bool:
        """Preempt lower-priority running requests not yet in this step until `request` can grow to
        `num_tokens`; False if even all of them are not enough."""
        while not self.blocks.can_allocate(request, num_tokens):
            # running is in priority order, so `request` comes up before anyone it outranks would.
            victim = next(r for r in reversed(self.running) if r is request or r.request_id not in scheduled)
            if victim is request:
                return False
            self._preempt(victim)
            preempted.append(victim.request_id)
        return True

    def _schedule_running(self, request: Request, num_new: int, rows: list[ScheduledRow], scheduled: set[str]) -> None:
        self.blocks.allocate(request, request.num_computed_tokens + num_new)
        rows.append(self._row(request, num_new))
        scheduled.add(request.request_id)

    def _row(self, request: Request, num_new: int) -> ScheduledRow:
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledRow(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_position=start,
            block_table=list(request.block_table),
            is_sampling=end == request.num_tokens,
            # Decoding = feeding the one newest sampled token; a resumed request's recompute is prefill.
            is_prefill=not (start == request.num_tokens - 1 and start >= request.num_prompt_tokens),
            num_prompt_logits=request.num_prompt_logits(start, end),
        )

    def _check_stop(self, request: Request, token: int) -> tuple[FinishReason | None, int | None]:
        params = request.params
        num_out = len(request.output_token_ids)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return FinishReason.STOP, None
            if token in params.stop_token_ids:
                return FinishReason.STOP, token
        if num_out >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.shares.started(request.tenant, -1)
        self.blocks.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.blocks.free(request)
            self.shares.started(request.tenant, -1)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            self.blocks.free(request)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        self.shares.leave(request.tenant)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_s = self.clock()
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
