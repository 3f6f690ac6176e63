"""What the live view costs: the same serving load with no viewer and with one viewer connected.

    python -m bench live-view                      # 96 requests x 64 tokens, 16 at a time, 5 rounds each

One `conveyor serve` (the bundled model, the engine core in its own process) and a second one
started with --no-dashboard. Rounds take turns (no-dashboard, unwatched, watched; the order rotates
each repetition) and each mode keeps its best output tokens per second. The viewer reads and
JSON-decodes the event stream as the page does. Reported: watched / unwatched (the cost of a
viewer) and unwatched / no-dashboard (the cost of the feature when nobody watches). Throughput swings
with whatever else the machine runs, so each round also records the CPU seconds its server's two
processes (front and engine core) spent per 1000 output tokens, from /proc: what a viewer costs in
work, whatever the contention.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import httpx

from bench import report
from bench.serving.client import run_serving
from bench.serving.metrics import summarize
from bench.serving.servers import conveyor_command, free_port, launched
from bench.workloads import offline_workload, warmup_workload

MODES = ("no-dashboard", "unwatched", "watched")
_TICKS_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU seconds of a process (the front) and of its children (the engine core), from /proc."""
    out = {"front": 0.0, "core": 0.0}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        this, parent = int(stat.parent.name), int(fields[1])
        if this == pid or parent == pid:
            out["front" if this == pid else "core"] += (int(fields[11]) + int(fields[12])) / _TICKS_S
    return out


class Viewer:
    """One viewer of /dashboard/events on a thread: counts updates and bytes, decodes every event."""

    def __init__(self, base_url: str) -> None:
        self.num_updates = 0
        self.num_bytes = 0
        self._stop = False
        self._thread = threading.Thread(target=self._read, args=(base_url,), daemon=True)
        self._thread.start()

    def _read(self, base_url: str) -> None:
        with httpx.Client(timeout=httpx.Timeout(30, read=60)) as client, \
                client.stream("GET", f"{base_url}/dashboard/events") as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if self._stop:
                    return
                if line.startswith("data: "):
                    self.num_bytes += len(line)
                    self.num_updates += json.loads(line[6:])["type"] == "update"

    def close(self) -> None:
        self._stop = True
        self._thread.join(30)   # the server pings every few seconds, so the loop sees the flag


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench live-view", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=300)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)
    print(f"CPU: {report.machine()}", flush=True)
    requests = offline_workload(args.num_requests, args.min_prompt, args.max_prompt, args.output_tokens)
    options = dict(model=args.model, threads=args.threads, max_num_seqs=args.concurrency,
                   max_num_batched_tokens=512, kv_cache_memory="1GiB", dtype=args.dtype)
    logs = Path("bench/results/live_view")
    ports = {"dashboard": free_port(), "no-dashboard": free_port()}
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with launched(conveyor_command(ports["dashboard"], **options), ports["dashboard"], logs / "dashboard.log") as on, \
            launched(conveyor_command(ports["no-dashboard"], **options) + ["--no-dashboard"], ports["no-dashboard"],
                     logs / "no-dashboard.log") as off:
        for server in (on, off):
            run_serving(server.base_url, warmup_workload(4, 8), max_concurrency=4)
        for rep in range(args.repetitions):
            order = MODES[rep % 3:] + MODES[:rep % 3]
            for mode in order:
                server = off if mode == "no-dashboard" else on
                viewer = Viewer(on.base_url) if mode == "watched" else None
                if viewer is not None:
                    time.sleep(1)   # connected, and the first updates through
                cpu_before = cpu_seconds(server.process.pid)
                run = run_serving(server.base_url, requests, max_concurrency=args.concurrency)
                cpu_after = cpu_seconds(server.process.pid)
                figures = summarize(run)
                for part in ("front", "core"):
                    figures[f"{part}_cpu_s_per_1k_tokens"] = \
                        1000 * (cpu_after[part] - cpu_before[part]) / figures["output_tokens"]
                if viewer is not None:
                    viewer.close()
                    figures["viewer_updates"] = viewer.num_updates
                    figures["viewer_updates_per_s"] = viewer.num_updates / run.duration_s
                    figures["viewer_bytes_per_update"] = viewer.num_bytes / max(1, viewer.num_updates)
                if figures["failed"]:
                    raise SystemExit(f"{mode}: {figures['failed']} requests failed: {figures['errors']}")
                runs[mode].append(figures)
                print(f"rep {rep} {mode:13s} {figures['output_tokens_per_s']:7.1f} output tok/s, ITL p50 "
                      f"{figures['itl_ms']['p50']:.1f} ms, CPU s per 1k tokens: front "
                      f"{figures['front_cpu_s_per_1k_tokens']:.3f}, core {figures['core_cpu_s_per_1k_tokens']:.3f}"
                      + (f", {figures['viewer_updates_per_s']:.1f} updates/s of "
                         f"{figures['viewer_bytes_per_update']:.0f} B" if viewer is not None else ""), flush=True)
    best = {mode: max(f["output_tokens_per_s"] for f in figures) for mode, figures in runs.items()}
    cpu = {mode: {part: statistics.median(f[f"{part}_cpu_s_per_1k_tokens"] for f in figures)
                  for part in ("front", "core")} for mode, figures in runs.items()}
    watched_ratio = best["watched"] / best["unwatched"]
    unwatched_ratio = best["unwatched"] / best["no-dashboard"]
    print(f"best output tok/s: no-dashboard {best['no-dashboard']:.1f}, unwatched {best['unwatched']:.1f}, "
          f"watched {best['watched']:.1f}")
    print(f"watched / unwatched: {watched_ratio:.3f} ({100 * (1 - watched_ratio):+.1f} % cost of one viewer); "
          f"unwatched / no-dashboard: {unwatched_ratio:.3f}")
    for mode in MODES:
        print(f"median CPU s per 1000 output tokens, {mode:13s}: front {cpu[mode]['front']:.3f}, "
              f"core {cpu[mode]['core']:.3f}, total {cpu[mode]['front'] + cpu[mode]['core']:.3f}")
    total = {mode: cpu[mode]["front"] + cpu[mode]["core"] for mode in MODES}
    print(f"CPU per token, watched / unwatched: {total['watched'] / total['unwatched']:.3f}; "
          f"unwatched / no-dashboard: {total['unwatched'] / total['no-dashboard']:.3f}")
    report.save_run("live-view", args.out_dir, {
        "options": options,
        "workload": {"num_requests": args.num_requests, "min_prompt": args.min_prompt, "max_prompt": args.max_prompt,
                     "output_tokens": args.output_tokens, "concurrency": args.concurrency},
        "runs": runs, "best_output_tokens_per_s": best, "median_cpu_s_per_1k_tokens": cpu,
        "cpu_watched_over_unwatched": total["watched"] / total["unwatched"],
        "cpu_unwatched_over_no_dashboard": total["unwatched"] / total["no-dashboard"],
        "watched_over_unwatched": watched_ratio, "unwatched_over_no_dashboard": unwatched_ratio})
