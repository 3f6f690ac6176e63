"""The serving client alone, against any OpenAI-compatible server that is already running.

    python -m bench serve --url http://127.0.0.1:8000 --rate 2 --num-requests 64
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import report
from bench.serving.client import run_serving
from bench.serving.metrics import samples, summarize
from bench.workloads import add_workload_arguments, offline_workload


def serve(args: argparse.Namespace) -> None:
    requests = offline_workload(args.num_requests, args.min_prompt, args.max_prompt, args.output_tokens,
                                seed=args.seed)
    rate = None if args.rate in (None, "inf") else float(args.rate)
    result = run_serving(args.url, requests, model=args.model_name, rate=rate, max_concurrency=args.concurrency,
                         seed=args.seed, logprobs=args.logprobs)
    fig = summarize(result, args.goodput_ttft_ms / 1000, args.goodput_tpot_ms / 1000)
    key = f"{args.label}"
    print(report.table({key: fig}, None))
    gp = fig["goodput"]
    print(f"completed {fig['completed']}/{fig['num_requests']}, output tokens {fig['output_tokens']} "
          f"(requested {fig['output_tokens_requested']}, counted from chunks {fig['chunk_tokens']}), "
          f"goodput {gp['requests_per_s']:.2f} req/s ({gp['good_requests']} within TTFT {gp['ttft_limit_ms']:.0f} ms, "
          f"TPOT {gp['tpot_limit_ms']:.0f} ms)")
    report.save_run("serve", args.out_dir, {"url": args.url, "results": {key: fig}, "samples": {key: samples(result)}})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model-name", default=None, help="the `model` field to send (default: none)")
    p.add_argument("--label", default="server")
    p.add_argument("--rate", default=None, help="Poisson arrivals in req/s (default: all at once)")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight")
    add_workload_arguments(p)
    p.add_argument("--logprobs", action="store_true")
    p.add_argument("--goodput-ttft-ms", type=float, default=2000.0)
    p.add_argument("--goodput-tpot-ms", type=float, default=250.0)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    serve(p.parse_args(argv))
