"""The prompt part of a step: chunks of prompts already started, then new admissions.

A mixin of Scheduler (scheduler.py owns the requests, the decode part of a step and `update`);
split out because the order in which prompts share what the decodes leave is a policy of its own.
Pure Python: no torch, no threads, no clock of its own.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.fairness import TenantShares
from conveyor.core.plan import ScheduledRow
from conveyor.core.request import Request, RequestStatus
from conveyor.core.step_cost import PrefillBudget, StepCostModel, StepShape


class PromptPhase:
    config: SchedulerConfig
    blocks: BlockManager
    cost_model: StepCostModel | None
    clock: Callable[[], float]
    shares: TenantShares
    waiting: list[Request]
    running: list[Request]

    def _schedule_prompts(self, rows: list[ScheduledRow], scheduled: set[str], preempted: list[str],
                          num_priority_preempted: int, budget: int) -> None:
        """Add prompt rows to the step after its decodes; `budget` is the step's token budget left."""
        chunks = [r for r in self.running if r.request_id not in scheduled]
        if not (chunks or self.waiting) or budget == 0:
            return
        prefill = self._prefill_budget(rows)
        for request in chunks:
            if request.status is not RequestStatus.RUNNING:
                continue
            start = request.num_computed_tokens
            num_new = prefill.take(start, min(request.num_tokens - start, budget), self._is_long(request))
            if num_new == 0:
                return
            if not self._make_room(request, start + num_new, scheduled, preempted):
                # Never preempt a decode already in the step: take what the free blocks hold and stop here.
                room = self.blocks.capacity(request) - start
                if room > 0:
                    self._schedule_running(request, min(room, num_new), rows, scheduled)
                return
            self._schedule_running(request, num_new, rows, scheduled)
            budget -= num_new

        # New requests join only when no running request had to give up its blocks for another's decode.
        while (self.waiting and budget > 0 and len(preempted) == num_priority_preempted
               and len(self.running) < self.config.max_num_seqs):
            request = self._next_waiting()
            if request is None or request.request_id in preempted:   # a victim waits at least a step
                break
            cached_ids = self.blocks.find_cached_blocks(request)  # waiting requests hold no KV
            num_cached = len(cached_ids) * self.blocks.block_size
            num_new = prefill.take(num_cached, min(request.num_tokens - num_cached, budget), self._is_long(request))
            if num_new == 0 or not self.blocks.can_allocate(request, num_cached + num_new, cached_ids):
                break
            self.waiting.remove(request)
            self.blocks.allocate(request, num_cached + num_new, cached_ids)
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.shares.started(request.tenant, 1)
            if request.first_scheduled_s is None:
                # Only a first admission counts: a resumed request hitting its own blocks is no prompt hit.
                request.first_scheduled_s = self.clock()
                request.num_cached_tokens = num_cached
                self.shares.charge(request.tenant, prompt_tokens=request.num_prompt_tokens - num_cached)
                if self.blocks.enable_prefix_caching:
                    self.blocks.record_lookup(request.num_tokens, num_cached)
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
            rows.append(self._row(request, num_new))
            budget -= num_new

    def _prefill_budget(self, rows: list[ScheduledRow]) -> PrefillBudget:
        target_ms = self.config.target_itl_ms
        if self.cost_model is None or target_ms is None or not rows:
            return PrefillBudget()
        return PrefillBudget(self.cost_model.cost, target_ms / 1000, self.config.min_prefill_chunk,
                             StepShape.from_rows(rows), self.config.long_prefill_max_slowdown)

    def _is_long(self, request: Request) -> bool:
        return request.num_prompt_tokens > self.config.long_prefill_threshold

    def _next_waiting(self) -> Request | None:
        """The next request to admit: of the best priority waiting, the head of the least-served
        tenant's queue; a tenant at its running cap is passed over. None if every tenant is capped."""
        cap = self.config.max_running_per_tenant
        if cap is None and len(self.shares.live) <= 1:
            return self.waiting[0]
        best: Request | None = None
        seen: set[str] = set()
        for request in self.waiting:
            if best is not None and request.priority != best.priority:
                break
            tenant = request.tenant
            if tenant in seen:
                continue
            seen.add(tenant)
            if cap is not None and self.shares.running.get(tenant, 0) >= cap:
                continue
            if best is None or self.shares.counter(tenant) < self.shares.counter(best.tenant):
                best = request
        return best

    def _preempt_for_priority(self, preempted: list[str]) -> None:
        """Make room for the best waiting request by preempting running ones of a worse priority,
        when the batch is full or the KV cache cannot take its first chunk. A request preempted
        max_priority_preemptions times is not picked again, so it cannot starve (a background one may be)."""
        if not self.waiting or not self.running or self.waiting[0].priority >= self.running[-1].priority:
            return
        candidate = self.waiting[0]
        first_chunk = min(candidate.num_tokens, self.config.max_num_batched_tokens)
        while (len(self.running) >= self.config.max_num_seqs
               or not self.blocks.can_allocate(candidate, first_chunk)):
            victim = next((r for r in reversed(self.running) if r.priority > candidate.priority
                           and (r.is_background or r.num_preemptions < self.config.max_priority_preemptions)), None)
            if victim is None:
                return
            self._preempt(victim)
            preempted.append(victim.request_id)

    # Provided by Scheduler.
    def _make_room(self, request: Request, num_tokens: int, scheduled: set[str], preempted: list[str]) -> bool:
        raise NotImplementedError

    def _schedule_running(self, request: Request, num_new: int, rows: list[ScheduledRow], scheduled: set[str]) -> None:
        raise NotImplementedError

    def _row(self, request: Request, num_new: int) -> ScheduledRow:
        raise NotImplementedError

    def _preempt(self, request: Request) -> None:
        raise NotImplementedError
