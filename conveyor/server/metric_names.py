"""The names the server's metrics go by, their buckets, and tenants as labels (metrics.py collects them)."""

from __future__ import annotations

import hashlib
import re

# vLLM's buckets, with finer low ends: a small model on a CPU steps in milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Metrics vLLM also exports carry its names, so its published Grafana dashboard fills; ours keep
# a `conveyor:` prefix. Labelled metrics appear once observed: vllm:request_success_total,
# vllm:spec_decode_num_accepted_tokens_per_pos{position} and conveyor:tenant_* (per tenant).
VLLM_METRIC_NAMES = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:iteration_tokens_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:cache_config_info",
)
CONVEYOR_METRIC_NAMES = (
    "conveyor:prefill_throughput_tokens_per_second",
    "conveyor:decode_throughput_tokens_per_second",
    "conveyor:avg_sequences_per_step",
    "conveyor:step_time_seconds",
    "conveyor:request_queue_time_by_cause_seconds",
    "conveyor:batch_config_info",
    "conveyor:prefix_cache_disk_read_bytes_total",
    "conveyor:prefix_cache_disk_written_bytes_total",
    "conveyor:prefix_cache_host_queries_total",
    "conveyor:prefix_cache_host_hits_total",
    "conveyor:prefix_cache_host_read_bytes_total",
    "conveyor:prefix_cache_host_written_bytes_total",
    "conveyor:prefix_cache_host_bytes",
    "conveyor:kv_cache_capacity_tokens",
    "conveyor:kv_cache_memory_bytes",
)
METRIC_NAMES = VLLM_METRIC_NAMES + CONVEYOR_METRIC_NAMES

# Tenants are named by clients: the first MAX_TENANT_LABELS get a label of their own, later ones
# share TENANT_OVERFLOW_LABEL, and each label is at most MAX_TENANT_LABEL_CHARS of [A-Za-z0-9._-],
# so no client can grow the metrics without bound.
MAX_TENANT_LABELS = 32
MAX_TENANT_LABEL_CHARS = 64
TENANT_OVERFLOW_LABEL = "(other)"
DEFAULT_TENANT_LABEL = "(default)"
_LABEL_CHARS = re.compile(r"[A-Za-z0-9._-]+")
_NOT_LABEL_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_LABEL_DIGEST_CHARS = 16


def tenant_label(tenant: str) -> str:
    """A tenant as a metrics label: itself if short and plain, else its plain part cut short and a
    digest of the whole, so two long names stay apart."""
    if len(tenant) <= MAX_TENANT_LABEL_CHARS and _LABEL_CHARS.fullmatch(tenant):
        return tenant
    digest = hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:_LABEL_DIGEST_CHARS]
    plain = _NOT_LABEL_CHARS.sub("_", tenant[:MAX_TENANT_LABEL_CHARS])
    return f"{plain[:MAX_TENANT_LABEL_CHARS - _LABEL_DIGEST_CHARS - 1]}-{digest}"
