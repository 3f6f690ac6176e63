"""LLMEngine: schedule -> run -> sample -> update, one step at a time, yielding per-request deltas.

Synchronous and single-threaded: the offline API calls `step()` in a loop; the server runs it on
one background thread. Text (detokenization, stop strings) is handled here, tokens in `core`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conveyor import kernels
from conveyor.config import EngineConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.plan import StepPlan
from conveyor.core.request import FinishReason, Request
from conveyor.core.scheduler import Scheduler
from conveyor.engine.stats import EngineStats, StepStats
from conveyor.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from conveyor.errors import InvalidRequest
from conveyor.model.loader import load_model, resolve_model_path
from conveyor.model.llama import LlamaModel
from conveyor.runtime.kv_cache import KVCache
from conveyor.runtime.model_runner import ModelRunner
from conveyor.runtime.sampler import Sampler, SamplingRow, TokenLogprobs, make_generator
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class RequestMetrics:
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int

    @property
    def queue_time_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: deltas, and on the last one the totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None   # set when finished
    prompt_token_ids: list[int] | None = None  # set when finished


@dataclass(slots=True)
class _Stream:
    """Engine-side state of one request: its text so far and how much of it was handed out."""

    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    text: str = ""
    num_emitted_chars: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        if config.model.threads is not None:
            torch.set_num_threads(config.model.threads)
        self.model_path: Path = resolve_model_path(config.model.model)
        self.device = torch.device(config.model.device)
        self.dtype = _DTYPES[config.model.dtype]
        self.kernel_library = kernels.library() if self.device.type == "cpu" else None
        self.model: LlamaModel = load_model(self.model_path, self.dtype, config.model.device, self.kernel_library,
                                            config.model.quantization)
        arch = self.model.arch
        self.tokenizer = (Tokenizer.from_gguf(self.model_path) if self.model_path.is_file()
                          else Tokenizer.from_hf_folder(self.model_path))
        self.model_name = config.model.served_model_name or self.model_path.name
        self.max_model_len = config.scheduler.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context length "
                             f"{arch.max_position_embeddings}")
        cache_cfg = config.cache
        num_blocks = cache_cfg.num_kv_blocks or KVCache.num_blocks_for(
            arch, cache_cfg.block_size, self.dtype, cache_cfg.kv_cache_bytes)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {cache_cfg.kv_cache_memory!r} is too small for one KV block "
                             f"({KVCache.bytes_per_block(arch, cache_cfg.block_size, self.dtype)} bytes)")
        self.kv_cache = KVCache(arch, num_blocks, cache_cfg.block_size, self.dtype, self.device)
        self.blocks = BlockManager(num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.max_model_len, clock)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device)
        self.sampler = Sampler(self.device)
        self.stats = EngineStats()
        self.last_step: StepStats | None = None
        self._streams: dict[str, _Stream] = {}
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB), max_model_len %d", num_blocks,
                    cache_cfg.block_size, self.kv_cache.tensor.nbytes / 2**30, self.max_model_len)

    # ------------------------------------------------------------ requests

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0,
                    arrival_s: float | None = None) -> str:
        """Tokenize and queue a request. Raises InvalidRequest / ContextLengthExceeded / QueueFull."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        prompt_token_ids = self.encode_prompt(prompt)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            arrival_s=self.clock() if arrival_s is None else arrival_s,
            max_tokens=params.max_tokens,
            eos_token_ids=self.tokenizer.eos_token_ids,
            priority=priority,
        )
        stream = _Stream(request, IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                         skip_special_tokens=params.skip_special_tokens),
                         make_generator(params, self.device))
        self.scheduler.add(request)   # last: a request the scheduler holds always has its stream
        self._streams[request_id] = stream
        return request_id

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequest("a prompt must be a string or a list of token ids", param="prompt")
        bad = [t for t in prompt if not 0 <= t < self.model.arch.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{self.model.arch.vocab_size - 1})",
                                 param="prompt")
        return list(prompt)

    def abort_request(self, request_id: str) -> bool:
        """Abort in any state; its KV blocks are free before the next step. False if unknown."""
        self._streams.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        started = self.clock()
        lookups_before = (self.blocks.num_query_tokens, self.blocks.num_hit_tokens)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        try:
            outputs = self._run(plan)
        except Exception as exc:  # a failed step fails its own requests; the engine goes on
            logger.exception("step failed; failing its %d requests", len(plan.rows))
            outputs = self._fail(plan, f"internal error while running the model: {exc}")
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
        )
        self.stats.record(step)
        self.last_step = step
        return outputs

    def _run(self, plan: StepPlan) -> list[RequestOutput]:
        batch, logits = self.runner.execute(plan)
        rows = []
        for request_id in batch.sampling_ids:
            stream = self._streams[request_id]
            request = stream.request
            rows.append(SamplingRow(request.params, request.prompt_token_ids, request.output_token_ids,
                                    stream.generator, request.eos_token_ids))
        sampled = self.sampler.sample(logits, rows)
        logprobs = dict(zip(batch.sampling_ids, sampled.logprobs))
        result = self.scheduler.update(plan, sampled.token_ids)
        outputs = []
        for update in result.updates:
            stream = self._streams.get(update.request_id)
            if stream is None:
                continue
            token_logprobs = logprobs.get(update.request_id)
            outputs.append(self._emit(stream, update.new_token_ids, update.finish_reason, update.stop_reason,
                                      [token_logprobs] if token_logprobs is not None else []))
        return outputs

    def _emit(self, stream: _Stream, token_ids: list[int], finish_reason: FinishReason | None,
              stop_reason: int | str | None, logprobs: list[TokenLogprobs]) -> RequestOutput:
        request, params = stream.request, stream.request.params
        delta = "".join(stream.detokenizer.push(t) for t in token_ids)
        searched_from = len(stream.text)
        stream.text += delta
        if params.stop:
            hit = self._find_stop(stream.text, params.stop, searched_from)
            if hit is not None:
                index, stop = hit
                stream.text = stream.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
                finish_reason, stop_reason = FinishReason.STOP, stop
                self.scheduler.finish(request.request_id, FinishReason.STOP, stop)
        finished = finish_reason is not None
        # While running, hold back a tail that could be the start of a stop string.
        hold = 0 if finished or not params.stop else max(len(s) for s in params.stop) - 1
        end = max(len(stream.text) - hold, stream.num_emitted_chars)
        new_text = stream.text[stream.num_emitted_chars:end]
        stream.num_emitted_chars = end
        output = RequestOutput(request.request_id, token_ids, new_text, logprobs)
        if finished:
            self._streams.pop(request.request_id, None)
            output.finished = True
            output.finish_reason = finish_reason.value
            output.stop_reason = stop_reason
            output.metrics = self._metrics(request)
            output.prompt_token_ids = request.prompt_token_ids
        return output

    @staticmethod
    def _find_stop(text: str, stops: list[str], searched_from: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in stops:
            index = text.find(stop, max(0, searched_from - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _fail(self, plan: StepPlan, message: str) -> list[RequestOutput]:
        outputs = []
        for row in plan.rows:
            stream = self._streams.pop(row.request_id, None)
            self.scheduler.finish(row.request_id, FinishReason.ERROR)
            if stream is not None:
                outputs.append(RequestOutput(row.request_id, [], "", finished=True, finish_reason="error",
                                             error=message, metrics=self._metrics(stream.request)))
        return outputs

    @staticmethod
    def _metrics(request: Request) -> RequestMetrics:
        return RequestMetrics(
            arrival_s=request.arrival_s,
            first_scheduled_s=request.first_scheduled_s,
            first_token_s=request.first_token_s,
            finished_s=request.finished_s,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
        )
