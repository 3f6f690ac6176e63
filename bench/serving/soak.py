"""Disconnect soak and overload against a real `conveyor serve`: many streams, a share of them
closed mid-stream, then a burst far past a small waiting queue. Reports outcomes (5xx must be 0),
KV blocks left in use, and the server's RSS, fds and threads before and after.

    python -m bench soak --model path/to/model --streams 2000 --concurrency 64
    python -m bench soak --streams 300 --overload 200       # the bundled model

Prints a table and writes JSON (`report.save_run`) to --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.report import save_run
from bench.serving.client import sse_lines
from bench.serving.servers import free_port, launched

LOGS = Path(__file__).resolve().parents[1] / "results"


def process_figures(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_kib": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"]),
            "fds": len(list(Path(f"/proc/{pid}/fd").iterdir()))}


def gauge(base_url: str, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def one_stream(http: httpx.AsyncClient, i: int, disconnect: bool, max_tokens: int) -> str:
    body = {"prompt": f"soak client {i}: tell me a story", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return str(response.status_code)
            last = ""
            async for line in sse_lines(response):
                if line.startswith("data: "):
                    if disconnect:
                        return "disconnected"
                    if '"error"' in line:
                        return "error event"
                    last = line
            return "completed" if last == "data: [DONE]" else "cut stream"
    except httpx.HTTPError as exc:
        return f"transport error: {type(exc).__name__}"


async def run_streams(base_url: str, num_streams: int, concurrency: int, disconnect_every: int,
                      max_tokens: int) -> Counter:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        async def one(i: int) -> str:
            async with gate:
                disconnect = disconnect_every > 0 and i % disconnect_every == disconnect_every - 1
                return await one_stream(http, i, disconnect, max_tokens)

        return Counter(await asyncio.gather(*(one(i) for i in range(num_streams))))


def wait_drained(base_url: str, timeout_s: float = 60.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        running, usage = gauge(base_url, "vllm:num_requests_running"), gauge(base_url, "vllm:kv_cache_usage_perc")
        if (running == 0 and usage == 0) or time.monotonic() > deadline:
            return running, usage
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model for `conveyor serve` (default: the bundled one)")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--disconnect-every", type=int, default=2, help="every Nth stream leaves mid-stream")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--overload", type=int, default=200, help="streams in one burst at a queue of 8 (0 = skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = parser.parse_args(argv)

    port = free_port()
    cmd = [sys.executable, "-m", "conveyor", "serve", "--port", str(port), "--threads", str(args.threads),
           "--kv-cache-memory", "256MiB", "--max-waiting-requests", "8", "--log-level", "WARNING"]
    if args.model:
        cmd += ["--model", args.model]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report: dict = {}
    with launched(cmd, port, LOGS / f"soak-{stamp}.log") as server:
        pid = server.process.pid
        asyncio.run(run_streams(server.base_url, 8, 8, 0, 4))            # warm-up
        wait_drained(server.base_url)
        report["before"] = process_figures(pid)
        started = time.perf_counter()
        report["soak"] = dict(asyncio.run(run_streams(server.base_url, args.streams, args.concurrency,
                                                      args.disconnect_every, args.max_tokens)))
        report["soak_s"] = round(time.perf_counter() - started, 1)
        if args.overload:
            report["overload"] = dict(asyncio.run(run_streams(server.base_url, args.overload, args.overload, 0,
                                                              args.max_tokens)))
        running, usage = wait_drained(server.base_url)
        report["after_running"], report["after_kv_usage"] = running, usage
        time.sleep(1.0)   # closed connections leave the server's fd table
        report["after"] = process_figures(pid)

    outcomes = Counter(report["soak"]) + Counter(report.get("overload", {}))
    report["num_5xx"] = sum(n for k, n in outcomes.items() if k.isdigit() and k.startswith("5"))
    report["num_lost"] = sum(n for k, n in outcomes.items()
                             if k not in ("completed", "disconnected", "429") and not k.isdigit())
    print(f"soak: {report['soak']} in {report['soak_s']} s; overload: {report.get('overload')}")
    print(f"5xx: {report['num_5xx']}, lost or cut: {report['num_lost']}, running after: {running:g}, "
          f"KV usage after: {usage:g}")
    for key in ("rss_kib", "fds", "threads"):
        print(f"{key:8} before {report['before'][key]:>9}  after {report['after'][key]:>9}")
    save_run("soak", args.out_dir, report)
    return 0 if report["num_5xx"] == 0 and report["num_lost"] == 0 and usage == 0 else 1
