"""The prompt part of a step: chunks of prompts already started, and new admissions.

A mixin of Scheduler (scheduler.py owns the requests, the decode part of a step and `update`); the
order in which prompts share what the decodes leave is a policy of its own:

- Started prompts go shortest remaining prefill first within a priority, then new ones in the
  waiting order (priority, tenants' turns, arrival).
- No prompt waits behind a longer one: before a started prompt's chunk, waiting prompts of its
  priority or better that need less than it still does are admitted ahead of it. The chunk keeps
  `min_prefill_chunk` tokens (or what it would get alone, if less) and the blocks for them, so a
  stream of short prompts never starves it; and since the newcomers' first tokens now wait on this
  step, the chunk is cut to the target ITL as beside decodes.
- A prompt whose next block is being computed by a running prompt of its priority or better (the
  same system prompt, document or conversation) waits for it and reuses it: computed once.

Every step also notes why each request not yet started was passed over (request.WAIT_CAUSES), and
its queue time is split by those causes. Pure Python: no torch, no threads, no clock of its own.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Callable

from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.fairness import TenantShares
from conveyor.core.plan import ScheduledRow
from conveyor.core.request import Request, RequestStatus
from conveyor.core.step_cost import PrefillBudget, StepCostModel, StepShape

# Waiting requests one admission pass may pass over (longer ones, prefix waiters) before it stops
# looking: a queue of thousands costs a bounded scan per step, not a quadratic one.
MAX_PASSED_OVER = 64


class PromptPhase:
    config: SchedulerConfig
    blocks: BlockManager
    cost_model: StepCostModel | None
    clock: Callable[[], float]
    shares: TenantShares
    requests: dict[str, Request]
    waiting: list[Request]
    running: list[Request]
    _wait_causes: dict[str, str]   # request id -> why it was passed over this step, where known
    _line_cause: str               # why admissions stopped this step

    def _schedule_prompts(self, rows: list[ScheduledRow], scheduled: set[str], preempted: list[str],
                          num_priority_preempted: int, budget: int) -> None:
        """Add prompt rows to the step after its decodes; `budget` is the step's token budget left."""
        chunks = sorted((r for r in self.running if r.request_id not in scheduled),
                        key=lambda r: (r.priority, r.num_tokens - r.num_computed_tokens))
        if not (chunks or self.waiting) or budget == 0:
            return
        # New requests join only when no running request had to give up its blocks for another's decode.
        can_admit = len(preempted) == num_priority_preempted
        if not can_admit:
            self._line_cause = "blocks"
        passed: set[str] = set()
        computing = self._prefixes_in_flight()
        prefill = self._prefill_budget(rows)
        for request in chunks:
            if request.status is not RequestStatus.RUNNING:
                continue
            start = request.num_computed_tokens
            is_long = self._is_long(request)
            num_new: int | None = None
            if can_admit and self.waiting:
                num_new, budget, prefill = self._admit_ahead(request, rows, scheduled, prefill, budget, passed,
                                                             computing, preempted)
            if num_new is None:
                num_new = prefill.take(start, request.max_chunk(start, budget), is_long)
            if num_new == 0:
                return
            if not self._make_room(request, start + num_new, scheduled, preempted):
                # Never preempt a decode already in the step: take what the free blocks hold. A chunk
                # later in this order may still outrank someone and make room, so the loop goes on
                # (stopping here could leave two started prompts each waiting on the other's blocks).
                room = self.blocks.capacity(request) - start
                if room > 0:
                    self._schedule_running(request, min(room, num_new), rows, scheduled)
                    budget -= min(room, num_new)
                self._line_cause = "blocks"
                continue
            self._schedule_running(request, num_new, rows, scheduled)
            budget -= num_new
        if can_admit:
            self._admit(rows, scheduled, prefill, budget, passed, computing, preempted)

    def _admit_ahead(self, chunk: Request, rows: list[ScheduledRow], scheduled: set[str], prefill: PrefillBudget,
                     budget: int, passed: set[str], computing: dict[bytes, int],
                     preempted: list[str]) -> tuple[int | None, int, PrefillBudget]:
        """Admit the waiting prompts that go ahead of a started prompt's next chunk; returns the chunk's
        size (None: nobody went ahead, size it as usual), the token budget and the prefill budget left."""
        start = chunk.num_computed_tokens
        is_long = self._is_long(chunk)
        held = min(self.config.min_prefill_chunk, prefill.peek(start, chunk.max_chunk(start, budget), is_long))
        untouched = copy.copy(prefill)
        prefill.take(start, held, is_long)   # held for the chunk before anyone goes ahead of it
        ahead = self._admit(rows, scheduled, prefill, budget - held, passed, computing, preempted,
                            before=chunk, held_blocks=self.blocks.num_new_blocks(chunk, start + held))
        if not ahead:
            return None, budget, untouched
        budget -= ahead
        if not prefill.is_limited:
            # The newcomers' first tokens wait on this step now: it is held to the target like a decode's.
            prefill = self._prefill_budget(rows)
            prefill.take(start, held, is_long)
        return held + prefill.take(start + held, chunk.max_chunk(start, budget) - held, is_long), budget, prefill

    def _admit(self, rows: list[ScheduledRow], scheduled: set[str], prefill: PrefillBudget, budget: int,
               passed: set[str], computing: dict[bytes, int], preempted: list[str], before: Request | None = None,
               held_blocks: int = 0) -> int:
        """Start waiting requests in the waiting order while the budgets and blocks allow; returns the
        tokens they took. With `before`, only those that go ahead of that started prompt's chunk,
        leaving `held_blocks` free for it. `passed` gathers the ids passed over for the whole step."""
        used = 0
        longer: set[str] = set()   # passed over for this chunk only
        while self.waiting and used < budget and len(longer) + len(passed) < MAX_PASSED_OVER:
            if len(self.running) >= self.config.max_num_seqs:
                self._line_cause = "budget"
                break
            request = self._next_waiting(passed | longer)
            if request is None:
                if any(r.request_id not in passed and r.request_id not in longer for r in self.waiting):
                    self._line_cause = "priority"   # every tenant left is at its running cap
                break
            if request.request_id in preempted:   # a victim waits at least a step
                break
            if before is not None and request.priority > before.priority:
                break
            cached_ids = self.blocks.find_cached_blocks(request)  # waiting requests hold no KV
            num_cached = len(cached_ids) * self.blocks.block_size
            if self._waits_for_prefix(request, len(cached_ids), computing):
                passed.add(request.request_id)
                self._wait_causes[request.request_id] = "prefix"
                continue
            remaining = request.num_tokens - num_cached
            if before is not None and remaining >= before.num_tokens - before.num_computed_tokens:
                if request.priority < before.priority:
                    break   # a better priority is never passed over for a shorter one
                longer.add(request.request_id)
                continue
            is_long = self._is_long(request)
            num_new = prefill.peek(num_cached, request.max_chunk(num_cached, budget - used), is_long)
            if num_new == 0:
                self._line_cause = "budget"
                break
            if self.blocks.num_new_blocks(request, num_cached + num_new, cached_ids) + held_blocks \
                    > self.blocks.num_free_blocks:
                self._line_cause = "blocks"
                break
            prefill.take(num_cached, num_new, is_long)
            self._start(request, cached_ids, num_new, rows, scheduled)
            used += num_new
            self._add_in_flight(computing, request)
        return used

    def _start(self, request: Request, cached_ids: list[int], num_new: int, rows: list[ScheduledRow],
               scheduled: set[str]) -> None:
        num_cached = len(cached_ids) * self.blocks.block_size
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
                self.blocks.record_lookup(request.num_tokens, num_cached, cached_ids)
        bisect.insort(self.running, request, key=lambda r: r.sort_key)
        rows.append(self._row(request, num_new))
        scheduled.add(request.request_id)

    def _prefixes_in_flight(self) -> dict[bytes, int]:
        """Hash -> best priority, of the full prompt blocks running requests have yet to compute."""
        computing: dict[bytes, int] = {}
        if self.blocks.enable_prefix_caching and self.waiting:
            for request in self.running:
                self._add_in_flight(computing, request)
        return computing

    def _add_in_flight(self, computing: dict[bytes, int], request: Request) -> None:
        if not self.blocks.enable_prefix_caching or request.num_computed_tokens >= request.num_prompt_tokens:
            return
        size = self.blocks.block_size
        for block_hash in request.block_hashes[request.num_computed_tokens // size:request.num_prompt_tokens // size]:
            computing[block_hash] = min(computing.get(block_hash, request.priority), request.priority)

    def _waits_for_prefix(self, request: Request, num_cached_blocks: int, computing: dict[bytes, int]) -> bool:
        """Whether the request's next block is one a running prompt is computing: it is then found in
        the cache a few steps later instead of being computed twice. Only behind a prompt of the same
        priority or better, so a better priority never waits on a worse one's slower chunks."""
        limit = (request.num_tokens - 1) // self.blocks.block_size   # find_cached_blocks' own limit
        # A request that skips the cache has no hashes to look for (and would recompute the block anyway).
        if request.skips_prefix_cache or not computing or num_cached_blocks >= min(limit, len(request.block_hashes)):
            return False
        return computing.get(request.block_hashes[num_cached_blocks], request.priority + 1) <= request.priority

    def _note_wait_causes(self, rows: list[ScheduledRow]) -> None:
        """Record why each request not yet started was passed over this step."""
        served = [self.requests[row.request_id].priority for row in rows
                  if row.is_prefill and row.request_id in self.requests]
        best = min(served, default=None)
        for request in self.waiting:
            if request.first_scheduled_s is None:
                cause = self._wait_causes.get(request.request_id)
                if cause is None:
                    cause = "priority" if best is not None and request.priority > best else self._line_cause
                request.wait_cause = cause

    def _charge_queue_time(self, now_s: float) -> None:
        """Add the time since the last step to each not yet started request's current wait cause."""
        for request in self.waiting:
            if request.first_scheduled_s is None:
                since = request.arrival_s if request.queue_mark_s is None else request.queue_mark_s
                by_cause = request.queue_s_by_cause
                by_cause[request.wait_cause] = by_cause.get(request.wait_cause, 0.0) + max(now_s - since, 0.0)
                request.queue_mark_s = now_s

    def _prefill_budget(self, rows: list[ScheduledRow]) -> PrefillBudget:
        target_ms = self.config.target_itl_ms
        if target_ms is None:
            return PrefillBudget()
        if not rows:
            return PrefillBudget(long_chunk_tokens=self.config.long_prefill_max_chunk)
        if self.cost_model is None:
            return PrefillBudget()
        return PrefillBudget(self.cost_model.cost, target_ms / 1000, self.config.min_prefill_chunk,
                             StepShape.from_rows(rows), self.config.long_prefill_max_slowdown)

    def _is_long(self, request: Request) -> bool:
        return request.num_prompt_tokens > self.config.long_prefill_threshold

    def _next_waiting(self, passed: set[str] | frozenset[str] = frozenset()) -> Request | None:
        """The next request to admit, leaving out those `passed` over: of the best priority waiting,
        the head of the least-served tenant's queue; a tenant at its running cap is passed over.
        None if every tenant is capped or nobody is left."""
        cap = self.config.max_running_per_tenant
        if cap is None and len(self.shares.live) <= 1:
            return next((r for r in self.waiting if r.request_id not in passed), None)
        best: Request | None = None
        seen: set[str] = set()
        for request in self.waiting:
            if request.request_id in passed:
                continue
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
