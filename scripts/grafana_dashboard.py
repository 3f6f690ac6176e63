"""Write docs/grafana/conveyor.json: a Grafana dashboard over conveyor's /metrics.

It has every panel of vLLM's published dashboard that applies to a CPU engine (same metric names),
and panels for what conveyor adds (steps, prefix cache, speculation, tenants). The panels live
here as data, so the JSON is regenerated rather than edited: `python scripts/grafana_dashboard.py`.
`PANELS` is also what tests/server/test_dashboard.py queries against a real Prometheus.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "conveyor.json"
SELECT = '{model_name="$model_name"}'
RATE = "[$__rate_interval]"


def quantiles(metric: str) -> list[tuple[str, str]]:
    """P50/P90/P99 and the mean of a histogram, over the rate window."""
    targets = [(f"histogram_quantile({q}, sum by(le) (rate({metric}_bucket{SELECT}{RATE})))", f"P{round(q * 100)}")
               for q in (0.5, 0.9, 0.99)]
    targets.append((f"rate({metric}_sum{SELECT}{RATE}) / rate({metric}_count{SELECT}{RATE})", "Mean"))
    return targets


def rate(metric: str, legend: str) -> tuple[str, str]:
    return f"rate({metric}{SELECT}{RATE})", legend


# (title, unit, panel type, [(PromQL, legend)], description)
PANELS: list[tuple[str, str, str, list[tuple[str, str]], str]] = [
    ("E2E Request Latency", "s", "timeseries", quantiles("vllm:e2e_request_latency_seconds"),
     "Arrival to last token, of finished requests."),
    ("Token Throughput", "short", "timeseries",
     [rate("vllm:prompt_tokens_total", "Prompt tokens/s"), rate("vllm:generation_tokens_total", "Generation tokens/s")],
     "Tokens per second over the rate window."),
    ("Time Per Output Token Latency", "s", "timeseries", quantiles("vllm:inter_token_latency_seconds"),
     "Time between successive tokens of a request, as its client sees them."),
    ("Scheduler State", "short", "timeseries",
     [(f"vllm:num_requests_running{SELECT}", "Running"), (f"vllm:num_requests_waiting{SELECT}", "Waiting")],
     "Requests in the running batch and in the waiting queue."),
    ("Time To First Token Latency", "s", "timeseries", quantiles("vllm:time_to_first_token_seconds"),
     "Arrival to first token."),
    ("KV Cache Utilization", "percentunit", "timeseries", [(f"vllm:kv_cache_usage_perc{SELECT}", "KV cache usage")],
     "Share of the paged KV cache's blocks in use."),
    ("Request Prompt Length", "short", "heatmap",
     [(f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{SELECT}{RATE}))", "{{le}}")],
     "Prompt tokens of finished requests."),
    ("Request Generation Length", "short", "heatmap",
     [(f"sum by(le) (increase(vllm:request_generation_tokens_bucket{SELECT}{RATE}))", "{{le}}")],
     "Output tokens of finished requests."),
    ("Finish Reason", "short", "timeseries",
     [(f"sum by(finished_reason) (increase(vllm:request_success_total{SELECT}{RATE}))", "{{finished_reason}}")],
     "Finished requests by reason: stop, length, abort, error."),
    ("Queue Time", "s", "timeseries", quantiles("vllm:request_queue_time_seconds"),
     "Arrival to first being scheduled."),
    ("Requests Prefill and Decode Time", "s", "timeseries",
     [(f"rate(vllm:request_prefill_time_seconds_sum{SELECT}{RATE}) / "
       f"rate(vllm:request_prefill_time_seconds_count{SELECT}{RATE})", "Prefill (mean)"),
      (f"rate(vllm:request_decode_time_seconds_sum{SELECT}{RATE}) / "
       f"rate(vllm:request_decode_time_seconds_count{SELECT}{RATE})", "Decode (mean)")],
     "First scheduled to first token; first token to last."),
    ("Max Generation Tokens per Request", "short", "timeseries",
     [(f"rate(vllm:request_max_num_generation_tokens_sum{SELECT}{RATE}) / "
       f"rate(vllm:request_max_num_generation_tokens_count{SELECT}{RATE})", "max_tokens (mean)")],
     "The output tokens finished requests were allowed."),
    ("Tokens per Engine Step", "short", "timeseries",
     quantiles("vllm:iteration_tokens_total") + [(f"conveyor:avg_sequences_per_step{SELECT}", "Sequences (avg)")],
     "Prefill and decode tokens computed per step, and the batch's rows."),
    ("Engine Step Time", "s", "timeseries", quantiles("conveyor:step_time_seconds"),
     "Wall time of one engine step (the floor of the inter-token latency)."),
    ("Prefix Cache Hit Rate", "percentunit", "timeseries",
     [(f"rate(vllm:prefix_cache_hits_total{SELECT}{RATE}) / rate(vllm:prefix_cache_queries_total{SELECT}{RATE})",
       "Hit rate (tokens)")],
     "Prompt tokens found in the prefix cache over prompt tokens looked up."),
    ("Preemptions", "short", "timeseries", [rate("vllm:num_preemptions_total", "Preemptions/s")],
     "Requests preempted to free KV blocks."),
    ("Speculative Decoding Acceptance", "percentunit", "timeseries",
     [(f"rate(vllm:spec_decode_num_accepted_tokens_total{SELECT}{RATE}) / "
       f"rate(vllm:spec_decode_num_draft_tokens_total{SELECT}{RATE})", "Accepted / drafted")],
     "Share of draft tokens the target model accepted (with --speculative)."),
    ("Generation Throughput per Tenant", "short", "timeseries",
     [(f"sum by(tenant) (rate(conveyor:tenant_generation_tokens_total{SELECT}{RATE}))", "{{tenant}}")],
     "Output tokens per second of finished requests, per tenant (X-Tenant or user)."),
]


def _panel(index: int, title: str, unit: str, kind: str, targets: list[tuple[str, str]], description: str) -> dict:
    datasource = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    panel = {
        "id": index + 1, "type": kind, "title": title, "description": description, "datasource": datasource,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"datasource": datasource, "expr": expr, "legendFormat": legend, "range": True,
                     "refId": chr(ord("A") + i), **({"format": "heatmap"} if kind == "heatmap" else {})}
                    for i, (expr, legend) in enumerate(targets)],
    }
    if kind == "heatmap":
        panel["options"] = {"calculate": False, "yAxis": {"unit": unit}}
    return panel


def dashboard() -> dict:
    return {
        "title": "conveyor", "uid": "conveyor-serving", "description": "conveyor: continuous batching on CPU",
        "schemaVersion": 39, "editable": True, "refresh": "10s", "time": {"from": "now-15m", "to": "now"},
        "tags": ["conveyor", "vllm"],
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "datasource", "type": "datasource", "query": "prometheus"},
            {"name": "model_name", "label": "model_name", "type": "query", "refresh": 1,
             "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
             "query": {"query": 'label_values({__name__=~"vllm:.*"}, model_name)', "refId": "model_name"},
             "definition": 'label_values({__name__=~"vllm:.*"}, model_name)'},
        ]},
        "panels": [_panel(i, *spec) for i, spec in enumerate(PANELS)],
    }


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {OUT} ({len(PANELS)} panels)")
