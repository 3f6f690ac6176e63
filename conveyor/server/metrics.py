"""Prometheus metrics of one server: the core's StepOutputs -> collectors.

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `conveyor:time_to_first_token_seconds`),
so existing dashboards work after a prefix change. Each server owns its own `CollectorRegistry`,
so several servers in one process (tests) never clash. `observe` is an AsyncEngine step observer
and runs on the event loop; it also writes the one log line per finished request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.messages import CoreLoad, StepOutputs, TokenDelta
from conveyor.engine.stats import EngineStats, StepStats

logger = logging.getLogger(__name__)

# vLLM's buckets, with finer low ends: a small model on a CPU steps in milliseconds.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

METRIC_NAMES = (
    "conveyor:time_to_first_token_seconds",
    "conveyor:inter_token_latency_seconds",
    "conveyor:request_queue_time_seconds",
    "conveyor:e2e_request_latency_seconds",
    "conveyor:num_requests_running",
    "conveyor:num_requests_waiting",
    "conveyor:kv_cache_usage_perc",
    "conveyor:num_preemptions_total",
    "conveyor:prompt_tokens_total",
    "conveyor:generation_tokens_total",
    "conveyor:prefix_cache_queries_total",
    "conveyor:prefix_cache_hits_total",
    "conveyor:request_success_total",
    "conveyor:prefill_throughput_tokens_per_second",
    "conveyor:decode_throughput_tokens_per_second",
    "conveyor:avg_sequences_per_step",
    "conveyor:step_time_seconds",
    "conveyor:batch_config_info",
    "conveyor:spec_decode_num_drafts_total",
    "conveyor:spec_decode_num_draft_tokens_total",
    "conveyor:spec_decode_num_accepted_tokens_total",
)  # and, once a draft is accepted, conveyor:spec_decode_num_accepted_tokens_per_pos{position=...};
# once a request finishes, conveyor:tenant_{requests,prompt_tokens,generation_tokens}_total and
# conveyor:tenant_request_queue_time_seconds, labelled with its tenant.

# Tenants are named by clients: the first MAX_TENANT_LABELS get a label of their own, later ones
# share TENANT_OVERFLOW_LABEL, so a client cannot grow the metrics without bound.
MAX_TENANT_LABELS = 32
TENANT_OVERFLOW_LABEL = "(other)"
DEFAULT_TENANT_LABEL = "(default)"


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
        self.stats = EngineStats()
        self.registry = CollectorRegistry()
        self._last_token_s: dict[str, float] = {}   # request_id -> when its last token came out
        r = self.registry
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.ttft = histogram("conveyor:time_to_first_token_seconds",
                              "Time from arrival to the first output token.", _TTFT_BUCKETS)
        self.itl = histogram("conveyor:inter_token_latency_seconds",
                             "Time between successive output tokens of a request.", _ITL_BUCKETS)
        self.queue_time = histogram("conveyor:request_queue_time_seconds",
                                    "Time from arrival to first being scheduled.", _REQUEST_BUCKETS)
        self.e2e = histogram("conveyor:e2e_request_latency_seconds",
                             "Time from arrival to the last output token, of finished requests.", _REQUEST_BUCKETS)
        self.step_time = histogram("conveyor:step_time_seconds", "Wall time of one engine step.", _STEP_BUCKETS)
        self.num_running = gauge("conveyor:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("conveyor:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("conveyor:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.prefill_tps = gauge("conveyor:prefill_throughput_tokens_per_second",
                                 "Prompt tokens per second over prefill-only steps, since start.")
        self.decode_tps = gauge("conveyor:decode_throughput_tokens_per_second",
                                "Decoded tokens per second over steps that decode, since start.")
        self.avg_rows = gauge("conveyor:avg_sequences_per_step", "Average sequences per engine step, since start.")
        self.preemptions = counter("conveyor:num_preemptions_total", "Requests preempted to free KV blocks.")
        self.prompt_tokens = counter("conveyor:prompt_tokens_total", "Prompt tokens of requests that finished.")
        self.generation_tokens = counter("conveyor:generation_tokens_total", "Output tokens generated.")
        self.prefix_queries = counter("conveyor:prefix_cache_queries_total",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("conveyor:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.")
        self.drafts = counter("conveyor:spec_decode_num_drafts_total", "Decodes that carried draft tokens.")
        self.draft_tokens = counter("conveyor:spec_decode_num_draft_tokens_total", "Draft tokens verified.")
        self.accepted_tokens = counter("conveyor:spec_decode_num_accepted_tokens_total", "Draft tokens accepted.")
        self._accepted_per_pos = Counter("conveyor:spec_decode_num_accepted_tokens_per_pos",
                                         "Drafts whose guess at this position (0 = first) was accepted.",
                                         ["model_name", "position"], registry=r)
        self._success = Counter("conveyor:request_success_total", "Finished requests by finish reason.",
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
                                       buckets=_REQUEST_BUCKETS, registry=r)
        self._tenant_labels: set[str] = set()
        self._model_name = model_name
        # Effective batching settings after preset and flags, as labels of a constant 1 (vLLM's *_info style).
        sched = engine.info.scheduler
        Gauge("conveyor:batch_config_info", "Effective batching settings (preset and flags applied).",
              labels + ["target_itl_ms", "max_num_seqs", "max_num_batched_tokens", "min_prefill_chunk"],
              registry=r).labels(model_name, "off" if sched.target_itl_ms is None else f"{sched.target_itl_ms:g}",
                                 str(sched.max_num_seqs), str(sched.max_num_batched_tokens),
                                 str(sched.min_prefill_chunk)).set(1)

    # ------------------------------------------------------------ event loop

    def observe(self, outputs: StepOutputs) -> None:
        """The AsyncEngine's observer: called with every message of the core."""
        if outputs.step is not None:
            self.stats.record(outputs.step)
            self._observe_step(outputs.step)
        now = self.clock()
        window = self._window
        if outputs.step is not None:
            window.prompt_tokens += outputs.step.num_prefill_tokens
        for delta in outputs.deltas:
            request_id = delta.request_id
            if delta.new_token_ids:
                window.generation_tokens += len(delta.new_token_ids)
                self.generation_tokens.inc(len(delta.new_token_ids))
                last_s = self._last_token_s.get(request_id)
                if last_s is not None:
                    self.itl.observe(now - last_s)
                self._last_token_s[request_id] = now
            if delta.finished:
                self._last_token_s.pop(request_id, None)
                self._observe_finished(delta)
        load = outputs.load
        if self.stats_log_interval_s and now - window.started_s >= self.stats_log_interval_s:
            self._log_stats(now, load)
        # Aborted requests never send a finished delta; drop their entries once they outnumber the live ones.
        if len(self._last_token_s) > load.num_running + load.num_waiting + self.engine.num_in_flight:
            for request_id in [r for r in self._last_token_s if r not in self.engine.processor]:
                del self._last_token_s[request_id]

    def _log_stats(self, now: float, load: CoreLoad) -> None:
        """vLLM's periodic line, when anything happened since the last one or anything is in flight."""
        window, seconds = self._window, now - self._window.started_s
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
        stats = self.stats
        self.step_time.observe(step.step_time_s)
        self.num_running.set(step.num_running)
        self.num_waiting.set(step.num_waiting)
        self.kv_usage.set(step.kv_usage)
        if step.num_preemptions:
            self.preemptions.inc(step.num_preemptions)
        if step.num_prefix_query_tokens:
            self.prefix_queries.inc(step.num_prefix_query_tokens)
        if step.num_prefix_hit_tokens:
            self.prefix_hits.inc(step.num_prefix_hit_tokens)
        if step.num_drafts:
            self.drafts.inc(step.num_drafts)
            self.draft_tokens.inc(step.num_draft_tokens)
            self.accepted_tokens.inc(step.num_accepted_tokens)
            for position, count in enumerate(step.accepted_per_position):
                if count:
                    self._accepted_per_pos.labels(self._model_name, str(position)).inc(count)
        self.prefill_tps.set(stats.prefill_tokens_per_s)
        self.decode_tps.set(stats.decode_tokens_per_s)
        self.avg_rows.set(stats.avg_rows_per_step)

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
        if metrics.ttft_s is not None:
            self.ttft.observe(metrics.ttft_s)
        if metrics.e2e_s is not None:
            self.e2e.observe(metrics.e2e_s)
        decode_s = (metrics.finished_s - metrics.first_token_s
                    if metrics.finished_s is not None and metrics.first_token_s is not None else 0.0)
        rate = (metrics.num_output_tokens - 1) / decode_s if decode_s > 0 else 0.0
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
        label = tenant or DEFAULT_TENANT_LABEL
        if label not in self._tenant_labels:
            if len(self._tenant_labels) >= MAX_TENANT_LABELS:
                return TENANT_OVERFLOW_LABEL
            self._tenant_labels.add(label)
        return label

    def refresh_load(self) -> None:
        # The core reports its load after every command it applies, so this is current even when idle.
        load = self.engine.load
        self.num_running.set(load.num_running)
        self.num_waiting.set(load.num_waiting)
        self.kv_usage.set(load.kv_usage)

    def render(self) -> bytes:
        self.refresh_load()
        return generate_latest(self.registry)


@dataclass(slots=True)
class _StatsWindow:
    """Tokens since the last periodic stats line."""

    started_s: float
    prompt_tokens: int = 0
    generation_tokens: int = 0


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"
