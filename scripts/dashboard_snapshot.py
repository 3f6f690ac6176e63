"""Serve a model under load, scrape it with a real Prometheus, and draw docs/grafana/conveyor.json's panels.

    python scripts/dashboard_snapshot.py [--model PATH] [--minutes 3] [--out docs/grafana/snapshot.png]

Needs `prometheus` on PATH (Debian: apt-get install prometheus) and matplotlib. Each panel's PromQL is
evaluated by Prometheus's range-query API exactly as Grafana would send it, then drawn with matplotlib
(Grafana itself is not packaged for Debian); `--keep` leaves both servers up to look at by hand.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.serving.client import wait_healthy  # noqa: E402
from bench.serving.servers import free_port  # noqa: E402

DASHBOARD = ROOT / "docs" / "grafana" / "conveyor.json"
PROMPTS = [
    "Summarize the following text in two sentences: {doc}",
    "Repeat the following text word for word: {doc}",
    "List three facts from this text: {doc}",
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one word.",
]
DOCS = ["The quick brown fox jumps over the lazy dog. " * 8,
        "Continuous batching gathers one token from every running sequence into one forward pass. " * 4]


def load(base_url: str, model: str, until_s: float, seed: int) -> None:
    """One client: chat requests back to back, as one of two tenants, some repeating a document."""
    rng = random.Random(seed)
    with httpx.Client(base_url=base_url, timeout=600) as client:
        while time.monotonic() < until_s:
            prompt = rng.choice(PROMPTS).format(doc=rng.choice(DOCS))
            client.post("/v1/chat/completions", headers={"X-Tenant": rng.choice(["alice", "bob"])}, json={
                "model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": rng.choice([16, 32, 64, 128]), "temperature": rng.choice([0, 0.7])})


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    body = httpx.get(f"{prometheus}/api/v1/query_range",
                     params={"query": expr, "start": start, "end": end, "step": step}, timeout=30).json()
    if body["status"] != "success":
        raise SystemExit(f"{expr}: {body}")
    return body["data"]["result"]


def draw(prometheus: str, model: str, start: float, end: float, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(14, 2.8 * rows))
    step = max(2.0, (end - start) / 120)
    for ax, panel in zip(axes.flat, panels):
        ax.set_title(panel["title"], fontsize=10)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("seconds", fontsize=7)
        ax.set_ylabel(panel["fieldConfig"]["defaults"]["unit"], fontsize=7)
        for target in panel["targets"]:
            expr = target["expr"].replace("$model_name", model).replace("$__rate_interval", "30s")
            result = query_range(prometheus, expr, start, end, step)
            if panel["type"] == "heatmap":
                _heatmap(ax, result, start)
                continue
            for series in result:
                legend = target["legendFormat"]
                for key, value in series["metric"].items():
                    legend = legend.replace("{{" + key + "}}", value)
                ax.plot([float(t) - start for t, _ in series["values"]], [float(v) for _, v in series["values"]],
                        label=legend, linewidth=1)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left", ncol=3)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"conveyor dashboard, {model}: Prometheus range queries of docs/grafana/conveyor.json", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


def _heatmap(ax, result: list[dict], start: float) -> None:
    """Cumulative `le` buckets over time -> requests per bucket over time, as Grafana's heatmap shows them."""
    buckets = sorted(result, key=lambda series: float(series["metric"]["le"]))
    if not buckets:
        return
    times = [float(t) - start for t, _ in buckets[0]["values"]]
    cumulative = [[float(v) for _, v in series["values"]] for series in buckets]
    rows = [[c - p for c, p in zip(row, below)] for row, below in zip(cumulative, [[0.0] * len(times)] + cumulative)]
    keep = [i for i, row in enumerate(rows) if any(v > 0 for v in row)]   # drop buckets no request fell in
    if not keep:
        return
    ax.imshow([rows[i] for i in keep], aspect="auto", origin="lower", cmap="Spectral_r",
              extent=(times[0], times[-1], -0.5, len(keep) - 0.5))
    ax.set_yticks(range(len(keep)), ["<= " + buckets[i]["metric"]["le"] for i in keep], fontsize=6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model to serve (default: the bundled one)")
    parser.add_argument("--minutes", type=float, default=3.0, help="how long to load the server")
    parser.add_argument("--clients", type=int, default=6, help="concurrent clients")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "grafana" / "snapshot.png")
    parser.add_argument("--keep", action="store_true", help="leave the servers running at the end")
    args = parser.parse_args()
    prometheus_bin = shutil.which("prometheus")
    if prometheus_bin is None:
        raise SystemExit("prometheus is not on PATH (Debian: apt-get install prometheus)")
    port, prom_port = free_port(), free_port()
    base_url, prometheus = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom_port}"
    serve = [sys.executable, "-m", "conveyor", "serve", "--port", str(port), "--speculative", "ngram"]
    server = subprocess.Popen(serve + ([args.model] if args.model else []))
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-prometheus-"))
    (workdir / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: 2s\nscrape_configs:\n  - job_name: conveyor\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{port}']\n")
    prom = subprocess.Popen([prometheus_bin, f"--config.file={workdir / 'prometheus.yml'}",
                             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(base_url, 300, is_alive=lambda: server.poll() is None)
        wait_healthy(prometheus, 60, is_alive=lambda: prom.poll() is None, path="/-/ready")
        model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        start = time.time()
        until = time.monotonic() + 60 * args.minutes
        clients = [threading.Thread(target=load, args=(base_url, model, until, i)) for i in range(args.clients)]
        for client in clients:
            client.start()
        for client in clients:
            client.join()
        time.sleep(6)   # the last scrapes
        draw(prometheus, model, start, time.time(), args.out)
        if args.keep:
            print(f"server {base_url}, Prometheus {prometheus}; Ctrl-C to stop")
            server.wait()
    finally:
        for process in (server, prom):
            process.terminate()
            process.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
