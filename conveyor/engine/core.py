"""EngineCore: the step loop over a scheduler and a runtime (runtime_builder.py); token ids in, token ids out.

The core never sees text. It runs in the offline process (`LLMEngine`), on the server's engine
thread, or alone in its own process (`core_process.py`); all three drive it the same way, through a
core client (core_client.py): commands into `handle`, one `StepOutputs` out of `step_or_fail`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from conveyor.config import EngineConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.plan import StepPlan
from conveyor.core.request import FinishReason, Request
from conveyor.core.scheduler import Scheduler
from conveyor.core.snapshot import SnapshotSchedule, take_snapshot
from conveyor.core.speculative import NgramProposer
from conveyor.core.step_cost import StepCostModel, StepShape
from conveyor.engine.messages import (
    AbortRequests,
    AddRequests,
    CoreCommand,
    FinishRequests,
    CoreInfo,
    CoreLoad,
    CoreRequest,
    RequestMetrics,
    StepOutputs,
    TokenDelta,
    WatchBatch,
)
from conveyor.engine.prompt_scoring import PromptScores
from conveyor.engine.stats import DraftTally, EngineStats, StepStats, tier_counts
from conveyor.runtime.step_sampling import sample_rows
from conveyor.engine.structured_output import StructuredOutputs, grammar_compiler
from conveyor.engine.thinking_budget import ThinkingBudgets
from conveyor.errors import ConveyorError, InvalidRequest
from conveyor.runtime.runtime_builder import Runtime, build_draft, build_runtime, log_batching
from conveyor.model.llama import LlamaModel
from conveyor.runtime.draft_model import DraftModelProposer
from conveyor.runtime.kv.prefix_tier import build_prefix_tier
from conveyor.runtime.tensor_parallel import WorkerLost
from conveyor.runtime.sampler import Sampler, make_generator

logger = logging.getLogger(__name__)

_IDLE_COMPILE_WAIT_S = 0.01


@dataclass(slots=True)
class _Live:
    request: Request
    generator: torch.Generator | None


class EngineCore:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic,
                 runtime: Runtime | None = None) -> None:
        """`runtime`: the model, KV cache and runner to step on; built from `config` when not given."""
        started = time.perf_counter()
        self.config = config
        self.clock = clock
        runtime = runtime if runtime is not None else build_runtime(config)
        self.model_path: Path = runtime.model_path
        self.device, self.dtype, self.quantization = runtime.device, runtime.dtype, runtime.quantization
        self.kernel_library = runtime.kernel_library
        self.model: LlamaModel = runtime.model
        self.kv_cache, self.runner = runtime.kv_cache, runtime.runner
        self.max_model_len = runtime.max_model_len
        num_threads, num_blocks, cache_cfg = runtime.num_threads, runtime.kv_cache.num_blocks, config.cache
        self.blocks = BlockManager(num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching)
        self.prefix_tier = build_prefix_tier(config, self.model_path, self.kv_cache, self.blocks, arch=self.model.arch,
                                             dtype=self.dtype, quantization=self.quantization, device=self.device,
                                             kernel_features=getattr(self.kernel_library, "features", None))
        self.cost_model = StepCostModel()
        spec = config.speculative
        proposer = (NgramProposer(spec.ngram_prompt_lookup_min, spec.ngram_prompt_lookup_max)
                    if spec.speculative == "ngram" else build_draft(config, runtime)
                    if spec.speculative == "draft_model" else None)
        self.draft = proposer if isinstance(proposer, DraftModelProposer) else None
        if self.draft is not None:   # seeded requests' guesses are drawn with a copy of their own generator
            self.draft.sampling_of = lambda request_id: ((live.request, live.generator)
                                                         if (live := self._live.get(request_id)) else None)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.max_model_len, clock, self.cost_model,
                                   proposer, spec.num_speculative_tokens)
        self.sampler = Sampler(self.device)
        self.structured = StructuredOutputs(grammar_compiler(self.model_path, self.model.vocab_size), num_threads)
        self._compiling: dict[str, Request] = {}   # constrained requests waiting for their grammar
        self.budgets = ThinkingBudgets(self.model.vocab_size)
        self.prompt_scores = PromptScores()
        self.stats = EngineStats()
        self.last_step: StepStats | None = None
        self._live: dict[str, _Live] = {}
        self._pending: list[TokenDelta] = []     # finished from outside since the last step
        self._rejected: list[tuple[str, ConveyorError]] = []
        self._has_news = False                   # commands applied since the last StepOutputs
        self._num_added = 0                      # requests taken from ADD commands since then
        self.snapshots = SnapshotSchedule()      # off until a live view watches
        self.info = CoreInfo(vocab_size=self.model.vocab_size, max_model_len=self.max_model_len,
                             num_kv_blocks=num_blocks, block_size=cache_cfg.block_size,
                             startup_s=time.perf_counter() - started, num_threads=num_threads,
                             scheduler=config.scheduler, dtype=str(self.dtype).removeprefix("torch."),
                             kv_cache_dtype=str(self.kv_cache.dtype).removeprefix("torch."),
                             kv_cache_bytes=self.kv_cache.tensor.nbytes,
                             enable_prefix_caching=cache_cfg.enable_prefix_caching, model_path=str(self.model_path),
                             prefix_cache_folder=self.prefix_tier.folder if self.prefix_tier else "",
                             weights=getattr(self.model, "weight_formats", None) or self.quantization
                             if self.quantization != "none" else str(self.dtype).removeprefix("torch."))
        logger.info("start-up: engine core ready in %.2f s (max_model_len %d)", self.info.startup_s,
                    self.max_model_len)
        log_batching(config, with_proposer=proposer is not None)

    # ------------------------------------------------------------ requests

    def add(self, core_request: CoreRequest) -> None:
        """Queue a request admitted by the front (front/admission.py). Raises InvalidRequest for a duplicate id."""
        params = core_request.params
        request = Request(
            request_id=core_request.request_id,
            prompt_token_ids=core_request.prompt_token_ids,
            params=params,
            arrival_s=core_request.arrival_s,
            max_tokens=core_request.max_tokens,
            eos_token_ids=core_request.eos_token_ids,
            priority=core_request.priority,
            tenant=core_request.tenant,
            is_background=core_request.is_background,
            # A forced end tag is one token a step: its drafts would all be refused.
            can_speculate=self.scheduler.num_speculative_tokens > 0 and params.thinking_budget is None,
        )
        if request.request_id in self._live:   # the scheduler does not see requests still compiling
            raise InvalidRequest(f"duplicate request id {request.request_id!r}")
        generator = make_generator(params, self.device)
        if generator is None and self.draft is not None and not params.is_greedy:
            # A generator of its own, seeded from the shared one: the same distribution, and the draft can
            # copy it to draw its guesses with the model's noise.
            generator = torch.Generator(device=self.device)
            generator.manual_seed(int(torch.randint(2**62, ())))
        if params.structured_outputs is not None:
            # Scheduled once its grammar is compiled, off the step path; the batch goes on meanwhile.
            self.structured.submit(request.request_id, params.structured_outputs)
            self._compiling[request.request_id] = request
        else:
            self._schedule(request)   # first: a refused request leaves no state behind
        self._live[request.request_id] = _Live(request, generator)
        if params.thinking_budget is not None:   # after the adds that may refuse it: nothing left behind
            self.budgets.add(request.request_id, params.thinking_budget)

    def _schedule(self, request: Request) -> None:
        """To the scheduler; first held while the disk tier reads its prompt's blocks back, if it has them."""
        if self.prefix_tier is None or not self.prefix_tier.hold(request):
            self.scheduler.add(request)

    def _schedule_compiled(self) -> None:
        """Hand requests whose grammar is ready to the scheduler; a failed compile ends its request."""
        for request_id, error in self.structured.take_compiled():
            request = self._compiling.pop(request_id, None)
            if request is None:
                continue
            try:
                if error is not None:
                    raise ConveyorError(f"the structured output grammar could not be compiled: {error}")
                self._schedule(request)
            except ConveyorError as exc:
                delta = self._end(request_id, FinishReason.ERROR, error=str(exc))
                if delta is not None:
                    self._pending.append(delta)

    def abort(self, request_id: str) -> bool:
        """Abort in any state; its KV blocks are free before the next step. False if unknown."""
        return self._end(request_id, FinishReason.ABORT) is not None

    def finish(self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None) -> TokenDelta | None:
        """End a request from outside (a stop string the front found); its last delta goes out with the next step."""
        if request_id not in self._live:
            return None
        delta = self._end(request_id, reason, stop_reason)
        if delta is not None:
            self._pending.append(delta)
        return delta

    def _end(self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None,
             error: str | None = None) -> TokenDelta | None:
        """The one teardown of a request the core still holds, in any state: its grammar, its KV blocks,
        its sampling state. Returns its last delta; None for a request the core does not hold."""
        live = self._live.pop(request_id, None)
        self.structured.drop(request_id)
        self.budgets.drop(request_id)
        self.prompt_scores.drop(request_id)
        is_held = self.prefix_tier is not None and self.prefix_tier.drop(request_id)
        if self._compiling.pop(request_id, None) is None and not is_held:
            self.scheduler.finish(request_id, reason, stop_reason)   # a no-op for a request it already finished
        if live is None:
            return None
        return TokenDelta(request_id, [], finish_reason=reason.value, stop_reason=stop_reason, error=error,
                          metrics=RequestMetrics.of(live.request))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling) or self._num_held() > 0

    def _num_held(self) -> int:
        return len(self.prefix_tier.held) if self.prefix_tier is not None else 0

    def handle(self, command: CoreCommand) -> None:
        """Apply one command from the front. A refused add is reported in the next StepOutputs."""
        self._has_news = True
        if isinstance(command, AddRequests):
            self._num_added += len(command.requests)
            for core_request in command.requests:
                try:
                    self.add(core_request)
                except ConveyorError as exc:
                    self._rejected.append((core_request.request_id, exc))
                except Exception as exc:  # a bug in admission fails this request, not the core
                    logger.exception("adding request %s failed", core_request.request_id)
                    self._rejected.append((core_request.request_id,
                                           ConveyorError(f"internal error while adding the request: {exc}")))
        elif isinstance(command, AbortRequests):
            for request_id in command.request_ids:
                self.abort(request_id)
        elif isinstance(command, FinishRequests):
            for request_id, stop in command.stops:
                self.finish(request_id, FinishReason.STOP, stop)
        elif isinstance(command, WatchBatch):
            self.snapshots.watch(command.interval_s)

    def close(self) -> None:
        """Stop what the core started beside itself (tensor-parallel workers, the disk tier's writer)."""
        self.runner.close()
        if self.prefix_tier is not None:
            self.prefix_tier.close()

    def has_news(self) -> bool:
        """True when a StepOutputs is owed to the front even without a step (a rejection, an abort)."""
        return self._has_news or bool(self._pending) or bool(self._rejected)

    def step_or_fail(self) -> StepOutputs:
        """`step`, except that a bug outside the model run fails every request instead of the caller.
        A lost tensor-parallel rank (WorkerLost) is raised: the core cannot go on."""
        try:
            return self.step()
        except WorkerLost:
            raise   # no step can run any more: the core stops, and its front fails every request (503)
        except Exception as exc:
            logger.exception("engine step failed; failing all %d requests", len(self._live))
            deltas = self._pending
            self._pending = []
            for request_id in list(self._live):
                deltas += self._fail_request(request_id, f"engine error: {exc}")
            return self._outputs(deltas, None)

    def take_news(self) -> StepOutputs:
        """What the commands since the last message owe the front, without a step: an in-process client's answer."""
        deltas, self._pending = self._pending, []
        return self._outputs(deltas, None)

    def load(self) -> CoreLoad:
        num_waiting = self.scheduler.num_waiting + len(self._compiling) + self._num_held()
        return CoreLoad(self.scheduler.num_running, num_waiting, self.blocks.num_used_blocks, self.blocks.usage)

    # ------------------------------------------------------------ one step

    def step(self) -> StepOutputs:
        """Schedule, run and sample one step. A step whose plan is empty runs nothing (`step` is None)."""
        if self._compiling:
            self._schedule_compiled()
        deltas, self._pending = self._pending, []
        started = self.clock()
        lookups_before = (self.blocks.num_query_tokens, self.blocks.num_hit_tokens)
        if self._num_held():
            for request in self.prefix_tier.take_ready():
                self.scheduler.add(request)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self.structured.wait(_IDLE_COMPILE_WAIT_S)   # only grammars or disk reads in flight: no busy spin
            if self._num_held():
                self.prefix_tier.wait(_IDLE_COMPILE_WAIT_S)
            return self._outputs(deltas, None)
        drafts = DraftTally()
        try:
            deltas += self._run(plan, drafts)
            failed = False
        except WorkerLost:
            raise
        except Exception as exc:  # a failed step fails its own requests; the engine goes on
            logger.exception("step failed; failing its %d requests", len(plan.rows))
            deltas += self._fail(plan, f"internal error while running the model: {exc}")
            failed = True
        if self.prefix_tier is not None:
            self.prefix_tier.save_new_blocks()
        step = StepStats(
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_tokens=plan.num_decode_tokens,
            num_rows=len(plan.rows),
            step_time_s=self.clock() - started,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_used=self.blocks.num_used_blocks,
            kv_usage=self.blocks.usage,
            num_preemptions=len(plan.preempted_ids),
            num_prefix_query_tokens=self.blocks.num_query_tokens - lookups_before[0],
            num_prefix_hit_tokens=self.blocks.num_hit_tokens - lookups_before[1],
            num_drafts=drafts.num_drafts,
            num_draft_tokens=drafts.num_draft_tokens,
            num_accepted_tokens=drafts.num_accepted_tokens,
            accepted_per_position=tuple(drafts.accepted_per_position),
            **tier_counts(self.prefix_tier),
        )
        self.stats.record(step)
        self.last_step = step
        # The cost model learns the model's step alone: the draft's guessing is weighed on its own.
        drafting_s = self.draft.take_seconds() if self.draft is not None else 0.0
        if not failed:   # a failed step's time says nothing about what a step costs
            self.cost_model.observe(StepShape.from_plan(plan), step.step_time_s - drafting_s)
        return self._outputs(deltas, step)

    def _outputs(self, deltas: list[TokenDelta], step: StepStats | None) -> StepOutputs:
        rejected, self._rejected = self._rejected, []
        num_added, self._num_added = self._num_added, 0
        self._has_news = False
        outputs = StepOutputs(deltas, self.load(), step, rejected, num_added)
        now_s = self.clock() if self.snapshots.interval_s is not None else 0.0   # unwatched: not even the clock
        if self.snapshots.is_due(now_s, not self.has_unfinished_requests()):
            outputs.snapshot = take_snapshot(now_s, self.scheduler.running, self.scheduler.waiting, self.blocks,
                                             self._compiling.values(), self.scheduler.last_served)
        return outputs

    def _run(self, plan: StepPlan, drafts: DraftTally) -> list[TokenDelta]:
        logits = self.runner.execute(plan)
        if self.draft is not None:   # the draft reads the same prompt chunks, so its guesses never wait on one
            self.draft.follow([(row, self._live[row.request_id].request.all_token_ids) for row in plan.rows
                               if row.is_prefill and row.request_id in self._live
                               and self._live[row.request_id].request.can_speculate])
        rows = [row for row in plan.rows if row.is_sampling]
        num_sampled = sum(row.num_logits for row in rows)
        if logits.shape[0] > num_sampled:   # the positions that score prompts follow the sampling rows'
            self.prompt_scores.add(logits[num_sampled:], plan.rows, {r.request_id: self._live[r.request_id].request
                                                                     for r in plan.rows if r.num_prompt_logits})
            logits = logits[:num_sampled]
        masks = self.structured.step_masks([(row.request_id, row.draft_token_ids) for row in rows
                                            if self.structured.is_constrained(row.request_id)])
        masks.update(self.budgets.forced_masks([row.request_id for row in rows]))   # over the grammar's
        sampled = sample_rows(self.sampler, logits, rows, {r.request_id: self._live[r.request_id].request for r in rows},
                              {r.request_id: self._live[r.request_id].generator for r in rows}, masks)
        deltas = []
        for request_id, message in sampled.failed.items():   # before update, which then skips them
            deltas += self._fail_request(request_id, message)
        logprobs = {row.request_id: entries for row, entries in zip(rows, sampled.logprobs)}
        result = self.scheduler.update(plan, sampled.emitted)
        for update in result.updates:
            drafts.add(update.num_draft_tokens, update.num_accepted_tokens)
            live = self._live.get(update.request_id)
            if live is None:
                continue
            new_token_ids = update.new_token_ids
            self.budgets.accept(update.request_id, new_token_ids)
            num_accepted = self.structured.accept(update.request_id, new_token_ids)
            if num_accepted < len(new_token_ids):
                if not self.structured.is_dead_end(update.request_id):
                    deltas += self._fail_request(update.request_id, "internal error: a sampled token broke the "
                                                 "request's structured output grammar")
                    continue
                # The grammar needs text no token writes: it ends here, with what it accepted.
                logger.info("request %s: its grammar allows no token of this vocabulary; it stops",
                            update.request_id)
                new_token_ids = new_token_ids[:num_accepted]
                update.finish_reason, update.stop_reason = FinishReason.STOP, None
                self.scheduler.finish(update.request_id, FinishReason.STOP)
            entries = logprobs[update.request_id][:len(new_token_ids)]
            delta = TokenDelta(update.request_id, new_token_ids,
                               entries if all(e is not None for e in entries) else [],
                               prompt_logprobs=self.prompt_scores.take(live.request))
            if update.finish_reason is not None:
                del self._live[update.request_id]
                self.structured.drop(update.request_id)
                self.budgets.drop(update.request_id)
                delta.finish_reason = update.finish_reason.value
                delta.stop_reason = update.stop_reason
                delta.metrics = RequestMetrics.of(live.request)
            deltas.append(delta)
        return deltas

    def _fail(self, plan: StepPlan, message: str) -> list[TokenDelta]:
        deltas = []
        for row in plan.rows:
            deltas += self._fail_request(row.request_id, message)
        return deltas

    def _fail_request(self, request_id: str, message: str) -> list[TokenDelta]:
        """End one request with an error its client sees; its blocks are free at once."""
        delta = self._end(request_id, FinishReason.ERROR, error=message)
        return [] if delta is None else [delta]
