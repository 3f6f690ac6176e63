"""The Grafana dashboards fill: every metric that vLLM's published dashboard and ours query is exported,
and, where Prometheus is installed (Debian's `prometheus` package), every panel of ours returns data
from a real scrape of a real server."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import RunningServer, free_port, start_server

from conveyor.server.metrics import METRIC_NAMES

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "conveyor.json"
# What vLLM's examples/online_serving/prometheus_grafana/grafana.json queries.
VLLM_DASHBOARD_METRICS = {
    "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds", "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_success_total", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_max_num_generation_tokens",
}
# Exported once observed, with a label of their own.
LABELLED = {"vllm:request_success_total", "vllm:spec_decode_num_accepted_tokens_per_pos",
            "conveyor:tenant_requests_total", "conveyor:tenant_prompt_tokens_total",
            "conveyor:tenant_generation_tokens_total", "conveyor:tenant_request_queue_time_seconds"}
SPEC_OPTIONS = dict(speculative="ngram", num_speculative_tokens=3, ngram_prompt_lookup_min=1)


def metric_names(expr: str) -> set[str]:
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in re.findall(r"(?:vllm|conveyor):\w+", expr)}


def panel_exprs() -> list[tuple[str, list[str]]]:
    doc = json.loads(DASHBOARD.read_text())
    return [(panel["title"], [target["expr"] for target in panel["targets"]]) for panel in doc["panels"]]


def test_dashboards_query_only_exported_metrics() -> None:
    exported = set(METRIC_NAMES) | LABELLED
    assert VLLM_DASHBOARD_METRICS <= exported, VLLM_DASHBOARD_METRICS - exported
    ours = set().union(*(metric_names(e) for _, exprs in panel_exprs() for e in exprs))
    assert ours <= exported, ours - exported
    assert {"vllm:kv_cache_usage_perc", "vllm:request_prefill_time_seconds"} <= ours


def test_committed_dashboard_is_the_generated_one() -> None:
    spec = importlib.util.spec_from_file_location("grafana_dashboard", ROOT / "scripts" / "grafana_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert json.loads(DASHBOARD.read_text()) == module.dashboard(), "run python scripts/grafana_dashboard.py"


@pytest.fixture
def prometheus_over(tiny_checkpoint: Path, tmp_path: Path) -> Iterator[tuple[str, RunningServer]]:
    """A speculating server and a Prometheus scraping it every second: (Prometheus URL, server)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Prometheus is not installed (Debian: apt-get install prometheus)")
    server = start_server(tiny_checkpoint, max_num_seqs=4, **SPEC_OPTIONS)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                      f"scrape_configs:\n  - job_name: conveyor\n    static_configs:\n"
                      f"      - targets: ['127.0.0.1:{server.server.port}']\n")
    process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        process.terminate()
        process.wait(30)
        server.stop()


def query(prometheus: str, expr: str) -> list[dict]:
    body = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def scrapes_so_far(prometheus: str) -> int | None:
    """Scrapes of the server Prometheus has stored; None while it is not ready yet."""
    try:
        if httpx.get(f"{prometheus}/-/ready", timeout=10).status_code != 200:
            return None
    except httpx.TransportError:
        return None
    result = query(prometheus, 'count_over_time(up{job="conveyor"}[10m])')
    return int(float(result[0]["value"][1])) if result else 0


def wait_for_scrapes(prometheus: str, count: int) -> None:
    """Until `count` more scrapes of the server have landed."""
    deadline = time.monotonic() + 60
    start = None
    while time.monotonic() < deadline:
        scrapes = scrapes_so_far(prometheus)
        if start is None:
            start = scrapes
        elif scrapes is not None and scrapes >= start + count:
            return
        time.sleep(0.25)
    pytest.fail("Prometheus did not scrape the server")


def test_every_panel_fills_from_a_real_scrape(prometheus_over: tuple[str, RunningServer]) -> None:
    prometheus, server = prometheus_over
    wait_for_scrapes(prometheus, 1)
    document = "the quick brown fox jumps over the lazy dog " * 6
    with httpx.Client(base_url=f"{server.base_url}/v1", timeout=60) as client:
        for i, tenant in enumerate(["alice", "bob", "alice"]):   # the third repeats the first: a prefix hit
            response = client.post("/completions", headers={"X-Tenant": tenant}, json={
                "model": server.model_name, "prompt": document if i != 1 else "hello world", "max_tokens": 16,
                "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
    wait_for_scrapes(prometheus, 3)
    for title, exprs in panel_exprs():
        values = []
        for expr in exprs:
            expr = expr.replace("$model_name", server.model_name).replace("$__rate_interval", "1m")
            values += [float(sample["value"][1]) for sample in query(prometheus, expr)]
        assert any(math.isfinite(v) for v in values), f"panel {title!r} is empty: {exprs}"
