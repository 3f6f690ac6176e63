"""Prometheus metrics of one server: the core's StepOutputs -> collectors.

What vLLM also measures is exported under vLLM's name and `model_name` label, so its dashboards
work unchanged (docs/grafana); metrics of our own carry a `conveyor:` prefix. Each server owns its own `CollectorRegistry`,
so several servers in one process (tests) never clash. `observe` is an AsyncEngine step observer
and runs on the event loop; it also writes the one log line per finished request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from conveyor.core.request import WAIT_CAUSES
from conveyor.front.async_engine import AsyncEngine
from conveyor.engine.messages import CoreLoad, StepOutputs, TokenDelta
from conveyor.engine.stats import EngineStats, StepStats

logger = logging.getLogger(__name__)

from conveyor.server.metric_names import (  # noqa: F401  (METRIC_NAMES, MAX_TENANT_LABEL_CHARS: re-exported)
    ITERATION_BUCKETS,
    ITL_BUCKETS,
    REQUEST_BUCKETS,
    STEP_BUCKETS,
    TTFT_BUCKETS,
    DEFAULT_TENANT_LABEL,
    MAX_TENANT_LABEL_CHARS,
    MAX_TENANT_LABELS,
    METRIC_NAMES,
    TENANT_OVERFLOW_LABEL,
    tenant_label,
)


_MAX_PENDING = 1024   # deferred observations held at most: a flush is a few ms of the loop, run warm


class ServerMetrics:
    """Collectors for one engine, labelled with the served model name as vLLM labels them.

    Everything comes from the core's messages: step statistics, token deltas (inter-token latency
    is timed here, as the tokens reach the front) and the request figures of the last delta.
    """

    def __init__(self, engine: AsyncEngine, model_name: str, clock: Callable[[], float] = time.monotonic,
                 stats_log_interval_s: float = 0.0) -> None:
        self.engine = engine
        self.clock = clock
        self.stats_log_interval_s = stats_log_interval_s
        self._window = _StatsWindow(clock())
        self._idle_since: float | None = clock()   # when the core last reported nothing running or waiting
        self.stats = EngineStats()
        self.registry = CollectorRegistry()
        self._last_token_s: dict[str, float] = {}   # request_id -> when its last token came out
        # The per-step and per-token observations, applied when /metrics is read (or past _MAX_PENDING):
        # an append on the event loop instead of a locked histogram update for each.
        self._pending: list[tuple[Histogram, float]] = []
        r = self.registry
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        token_buckets = _one_two_five(engine.info.max_model_len)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Time from arrival to the first output token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between successive output tokens of a request.", ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Time between successive output tokens (vLLM's older name of the inter-token latency).",
                              ITL_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Per request: decode time over output tokens after the first.", ITL_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Time from arrival to first being scheduled.", REQUEST_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Time from first being scheduled to the first output token.", REQUEST_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Time from the first output token to the last.", REQUEST_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Time from first being scheduled to the last output token.", REQUEST_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Time from arrival to the last output token, of finished requests.", REQUEST_BUCKETS)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.",
                                        token_buckets)
        self.request_generation = histogram("vllm:request_generation_tokens", "Output tokens per finished request.",
                                            token_buckets)
        self.request_max_generation = histogram("vllm:request_max_num_generation_tokens",
                                                "Output tokens a finished request was allowed (max_tokens, resolved).",
                                                token_buckets)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "max_tokens of finished requests (resolved against the model length).",
                                            token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens computed per engine step.",
                                          ITERATION_BUCKETS)
        self.step_time = histogram("conveyor:step_time_seconds", "Wall time of one engine step.", STEP_BUCKETS)
        self.num_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.kv_usage_old = gauge("vllm:gpu_cache_usage_perc",
                                  "Fraction of KV cache blocks in use (0..1), under vLLM's older name.")
        self.prefill_tps = gauge("conveyor:prefill_throughput_tokens_per_second",
                                 "Prompt tokens per second over prefill-only steps, since start.")
        self.decode_tps = gauge("conveyor:decode_throughput_tokens_per_second",
                                "Decoded tokens per second over steps that decode, since start.")
        self.avg_rows = gauge("conveyor:avg_sequences_per_step", "Average sequences per engine step, since start.")
        self.preemptions = counter("vllm:num_preemptions_total", "Requests preempted to free KV blocks.")
        self.prompt_tokens = counter("vllm:prompt_tokens_total", "Prompt tokens of requests that finished.")
        self.generation_tokens = counter("vllm:generation_tokens_total", "Output tokens generated.")
        self.prefix_queries = counter("vllm:prefix_cache_queries_total",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache in memory.")
        # The disk tier (--prefix-cache-dir) stands where vLLM's KV connectors do: "external".
        self.disk_queries = counter("vllm:external_prefix_cache_queries_total",
                                    "Prompt tokens past the memory hits looked up in the prefix cache on disk.")
        self.disk_hits = counter("vllm:external_prefix_cache_hits_total",
                                 "Prompt tokens read back from the prefix cache on disk and used.")
        self.disk_read = counter("conveyor:prefix_cache_disk_read_bytes_total", "Bytes of KV blocks read from disk.")
        self.disk_written = counter("conveyor:prefix_cache_disk_written_bytes_total",
                                    "Bytes of KV blocks written to disk (counted with the next engine step).")
        self.host_queries = counter("conveyor:prefix_cache_host_queries_total",
                                    "Prompt tokens past the memory hits looked up in the prefix cache in host memory.")
        self.host_hits = counter("conveyor:prefix_cache_host_hits_total",
                                 "Prompt tokens copied back from the prefix cache in host memory and used.")
        self.host_read = counter("conveyor:prefix_cache_host_read_bytes_total",
                                 "Bytes of KV blocks copied from host memory into the KV cache.")
        self.host_written = counter("conveyor:prefix_cache_host_written_bytes_total",
                                    "Bytes of KV blocks copied from the KV cache to host memory.")
        self.host_bytes = gauge("conveyor:prefix_cache_host_bytes", "Bytes of KV blocks held in host memory.")
        self.drafts = counter("vllm:spec_decode_num_drafts_total", "Decodes that carried draft tokens.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens_total", "Draft tokens verified.")
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted.")
        self._accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Drafts whose guess at this position (0 = first) was accepted.",
                                         ["model_name", "position"], registry=r)
        self._success = Counter("vllm:request_success_total", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        tenant_labels = ["model_name", "tenant"]
        self._tenant_requests = Counter("conveyor:tenant_requests_total", "Finished requests per tenant.",
                                        tenant_labels, registry=r)
        self._tenant_prompt = Counter("conveyor:tenant_prompt_tokens_total",
                                      "Prompt tokens of finished requests per tenant.", tenant_labels, registry=r)
        self._tenant_generation = Counter("conveyor:tenant_generation_tokens_total",
                                          "Output tokens of finished requests per tenant.", tenant_labels, registry=r)
        self._tenant_queue = Histogram("conveyor:tenant_request_queue_time_seconds",
                                       "Time from arrival to first being scheduled, per tenant.", tenant_labels,
                                       buckets=REQUEST_BUCKETS, registry=r)
        self._tenant_labels: set[str] = set()
        # Every finished request observes each cause (0 where it never waited for it): _sum / _count compare.
        by_cause = Histogram("conveyor:request_queue_time_by_cause_seconds", "Time from arrival to first being "
                             "scheduled, split by why: budget, blocks, priority, prefix (waiting for a shared "
                             "prefix another request is computing).", ["model_name", "cause"],
                             buckets=REQUEST_BUCKETS, registry=r)
        self._queue_by_cause = {cause: by_cause.labels(model_name, cause) for cause in WAIT_CAUSES}
        self._model_name = model_name
        # Effective batching settings after preset and flags, as labels of a constant 1 (vLLM's *_info style).
        sched = engine.info.scheduler
        Gauge("conveyor:batch_config_info", "Effective batching settings (preset and flags applied).",
              labels + ["target_itl_ms", "max_num_seqs", "max_num_batched_tokens", "min_prefill_chunk",
                        "long_prefill_token_threshold", "long_prefill_max_slowdown", "long_prefill_max_chunk"],
              registry=r).labels(model_name, "off" if sched.target_itl_ms is None else f"{sched.target_itl_ms:g}",
                                 str(sched.max_num_seqs), str(sched.max_num_batched_tokens),
                                 str(sched.min_prefill_chunk), str(sched.long_prefill_threshold),
                                 "off" if sched.long_prefill_max_slowdown is None
                                 else f"{sched.long_prefill_max_slowdown:g}",
                                 "off" if sched.long_prefill_max_chunk is None or sched.target_itl_ms is None
                                 else str(sched.long_prefill_max_chunk)).set(1)
        info = engine.info
        Gauge("vllm:cache_config_info", "KV cache settings, as labels of a constant 1.",
              labels + ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"],
              registry=r).labels(model_name, str(info.block_size), str(info.num_kv_blocks), info.kv_cache_dtype,
                                 str(info.enable_prefix_caching)).set(1)
        Gauge("conveyor:kv_cache_capacity_tokens", "Tokens the KV cache holds (blocks x block size).", labels,
              registry=r).labels(model_name).set(info.num_kv_blocks * info.block_size)
        Gauge("conveyor:kv_cache_memory_bytes", "Bytes of the KV cache, an int8 cache's scales included.", labels,
              registry=r).labels(model_name).set(info.kv_cache_bytes)

    # ------------------------------------------------------------ event loop

    def observe(self, outputs: StepOutputs) -> None:
        """The AsyncEngine's observer: called with every message of the core."""
        if outputs.step is not None:
            self.stats.record(outputs.step)
            self._observe_step(outputs.step)
        now = self.clock()
        window = self._window
        if self._idle_since is not None:
            # An idle gap is no part of an average: this message's own step ran just before it came.
            step_s = outputs.step.step_time_s if outputs.step is not None else 0.0
            window.idle_s += max(0.0, now - self._idle_since - step_s)
            self._idle_since = None
        if outputs.step is not None:
            window.prompt_tokens += outputs.step.num_prefill_tokens
        num_generated = 0
        for delta in outputs.deltas:
            request_id = delta.request_id
            if delta.new_token_ids:
                num_generated += len(delta.new_token_ids)
                last_s = self._last_token_s.get(request_id)
                if last_s is not None:
                    self._defer(self.itl, now - last_s)
                    self._defer(self.tpot, now - last_s)
                self._last_token_s[request_id] = now
            if delta.finished:
                self._last_token_s.pop(request_id, None)
                self._observe_finished(delta)
        if num_generated:   # one locked increment per message, not one per row
            window.generation_tokens += num_generated
            self.generation_tokens.inc(num_generated)
        load = outputs.load
        if self.stats_log_interval_s and window.active_s(now) >= self.stats_log_interval_s:
            self._log_stats(now, load)
        if not (load.num_running or load.num_waiting):
            self._idle_since = now
        # Aborted requests never send a finished delta; drop their entries once they outnumber the live ones.
        if len(self._last_token_s) > load.num_running + load.num_waiting + self.engine.num_in_flight:
            for request_id in [r for r in self._last_token_s if r not in self.engine.processor]:
                del self._last_token_s[request_id]

    def _log_stats(self, now: float, load: CoreLoad) -> None:
        """vLLM's periodic line, when anything happened since the last one or anything is in flight."""
        window = self._window
        seconds = window.active_s(now)
        self._window = _StatsWindow(now)
        if not (window.prompt_tokens or window.generation_tokens or load.num_running or load.num_waiting):
            return
        stats = self.stats
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%%s",
                    window.prompt_tokens / seconds, window.generation_tokens / seconds, load.num_running,
                    load.num_waiting, 100 * load.kv_usage, 100 * stats.prefix_hit_rate,
                    f", Draft acceptance rate: {100 * stats.draft_acceptance_rate:.1f}%"
                    if stats.num_draft_tokens else "")

    def _observe_step(self, step: StepStats) -> None:
        self._defer(self.step_time, step.step_time_s)
        self._defer(self.iteration_tokens, step.num_prefill_tokens + step.num_decode_tokens)
        if step.num_preemptions:
            self.preemptions.inc(step.num_preemptions)
        if step.num_prefix_query_tokens:
            self.prefix_queries.inc(step.num_prefix_query_tokens)
        if step.num_prefix_memory_hit_tokens:
            self.prefix_hits.inc(step.num_prefix_memory_hit_tokens)
        for tier, (queries, hits, read, written) in (
                (step.disk, (self.disk_queries, self.disk_hits, self.disk_read, self.disk_written)),
                (step.host, (self.host_queries, self.host_hits, self.host_read, self.host_written))):
            if tier is not None:
                for metric, value in ((queries, tier.num_query_tokens), (hits, tier.num_hit_tokens),
                                      (read, tier.bytes_read), (written, tier.bytes_written)):
                    metric.inc(value)
        if step.host is not None:
            self.host_bytes.set(step.host.nbytes)
        if step.num_drafts:
            self.drafts.inc(step.num_drafts)
            self.draft_tokens.inc(step.num_draft_tokens)
            self.accepted_tokens.inc(step.num_accepted_tokens)
            for position, count in enumerate(step.accepted_per_position):
                if count:
                    self._accepted_per_pos.labels(self._model_name, str(position)).inc(count)

    def _observe_finished(self, output: TokenDelta) -> None:
        self._success.labels(self._model_name, output.finish_reason or "unknown").inc()
        metrics = output.metrics
        if metrics is None:
            return
        self.prompt_tokens.inc(metrics.num_prompt_tokens)
        tenant = self._tenant_label(metrics.tenant)
        self._tenant_requests.labels(self._model_name, tenant).inc()
        self._tenant_prompt.labels(self._model_name, tenant).inc(metrics.num_prompt_tokens)
        self._tenant_generation.labels(self._model_name, tenant).inc(metrics.num_output_tokens)
        if metrics.queue_time_s is not None:
            self.queue_time.observe(metrics.queue_time_s)
            self._tenant_queue.labels(self._model_name, tenant).observe(metrics.queue_time_s)
            for cause, histogram in self._queue_by_cause.items():
                histogram.observe(metrics.queue_s_by_cause.get(cause, 0.0))
        if metrics.ttft_s is not None:
            self.ttft.observe(metrics.ttft_s)
        if metrics.e2e_s is not None:
            self.e2e.observe(metrics.e2e_s)
        self.request_prompt.observe(metrics.num_prompt_tokens)
        self.request_generation.observe(metrics.num_output_tokens)
        self.request_max_generation.observe(metrics.max_tokens)
        self.request_max_tokens.observe(metrics.max_tokens)
        scheduled_s, first_token_s, finished_s = metrics.first_scheduled_s, metrics.first_token_s, metrics.finished_s
        if scheduled_s is not None and first_token_s is not None:
            self.prefill_time.observe(first_token_s - scheduled_s)
        if scheduled_s is not None and finished_s is not None:
            self.inference_time.observe(finished_s - scheduled_s)
        decode_s = finished_s - first_token_s if finished_s is not None and first_token_s is not None else 0.0
        if first_token_s is not None and finished_s is not None:
            self.decode_time.observe(decode_s)
        rate = (metrics.num_output_tokens - 1) / decode_s if decode_s > 0 else 0.0
        if metrics.num_output_tokens > 1:
            self.request_tpot.observe(decode_s / (metrics.num_output_tokens - 1))
        level = logging.WARNING if output.error else logging.INFO
        logger.log(level, "request %s finished (%s): %d prompt tokens (%d cached), %d output tokens, "
                   "queue %s, TTFT %s, e2e %s, decode %.1f tokens/s, %d preemptions%s%s",
                   output.request_id, output.finish_reason, metrics.num_prompt_tokens, metrics.num_cached_tokens,
                   metrics.num_output_tokens, _seconds(metrics.queue_time_s), _seconds(metrics.ttft_s),
                   _seconds(metrics.e2e_s), rate, metrics.num_preemptions,
                   f", draft acceptance {metrics.num_accepted_tokens / metrics.num_draft_tokens:.0%} "
                   f"({metrics.num_accepted_tokens}/{metrics.num_draft_tokens})" if metrics.num_draft_tokens else "",
                   f"; error: {output.error}" if output.error else "")

    def _tenant_label(self, tenant: str) -> str:
        label = tenant_label(tenant) if tenant else DEFAULT_TENANT_LABEL
        if label not in self._tenant_labels:
            if len(self._tenant_labels) >= MAX_TENANT_LABELS:
                return TENANT_OVERFLOW_LABEL
            self._tenant_labels.add(label)
        return label

    def refresh_load(self) -> None:
        # The core reports its load after every command it applies, so this is current even when idle.
        load = self.engine.load
        self._set_load(load.num_running, load.num_waiting, load.kv_usage)

    def _set_load(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
        self.kv_usage_old.set(kv_usage)

    def _defer(self, histogram: Histogram, value: float) -> None:
        self._pending.append((histogram, value))
        if len(self._pending) >= _MAX_PENDING:
            self._apply_pending()

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for histogram, value in pending:
            histogram.observe(value)

    def render(self) -> bytes:
        # Gauges of the latest state are set here, when read, not at every step on the event loop.
        self._apply_pending()
        self.refresh_load()
        stats = self.stats
        self.prefill_tps.set(stats.prefill_tokens_per_s)
        self.decode_tps.set(stats.decode_tokens_per_s)
        self.avg_rows.set(stats.avg_rows_per_step)
        return generate_latest(self.registry)


@dataclass(slots=True)
class _StatsWindow:
    """Tokens since the last periodic stats line, and the time the engine had work in that span."""

    started_s: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    idle_s: float = 0.0          # nothing running or waiting: left out of the averages

    def active_s(self, now: float) -> float:
        return max(now - self.started_s - self.idle_s, 1e-9)


def _one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"
