"""python -m bench {run,serve,limits,capacity,interference,head-of-line,accuracy}: see BENCHMARKS.md.

    python -m bench run                                   # every system, the full default workload
    python -m bench run --systems conveyor,llama-server-f32 --num-requests 8 --output-tokens 32 --concurrency 8
    python -m bench run --model FILE.gguf --systems conveyor-server,llama-server   # llama-server serves FILE.gguf
    python -m bench serve --url http://127.0.0.1:8000 --rate 2 --num-requests 64
    python -m bench limits --threads 2
    python -m bench capacity [--model FILE.gguf --ttft-ms 4000 --tpot-ms 200]   # capacity under a latency SLO
    python -m bench interference [--model FILE.gguf]      # a 4096-token prompt arrives while 8 streams decode
    python -m bench head-of-line [--model FILE.gguf]      # a 16-token request 2 s after a 4000-token prompt
    python -m bench accuracy [--model FILE.gguf]          # perplexity, KL vs the float model; llama-perplexity too
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench import report
from bench.accuracy import perplexity as accuracy
from bench.kernels import limits
from bench.peers import run
from bench.serving import capacity, head_of_line, interference
from bench.serving.client import run_serving
from bench.serving.metrics import samples, summarize
from bench.workloads import add_workload_arguments, offline_workload


def serve(args: argparse.Namespace) -> None:
    """The serving client alone, against any OpenAI-compatible server that is already running."""
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
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out_dir / f"serve-{stamp}.json"
    report.write_json(out, {"command": "python -m bench " + " ".join(sys.argv[1:]), "machine": report.machine(),
                            "versions": report.versions(None), "url": args.url, "results": {key: fig},
                            "samples": {key: samples(result)}})
    print(f"JSON: {out}")


def limits_cmd(args: argparse.Namespace) -> None:
    lim = limits.measure(args.model, args.threads, run.int_list(args.batch_sizes))
    document = {"limits": lim, "results": {}, "base": None, "single_request_decode": {"conveyor": None},
                "goals": []}
    run.print_summary(document, None)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="conveyor and its peers on one workload, in one run")
    run.add_arguments(p_run)
    p_serve = sub.add_parser("serve", help="the serving client against a running OpenAI-compatible server")
    p_serve.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p_serve.add_argument("--model-name", default=None, help="the `model` field to send (default: none)")
    p_serve.add_argument("--label", default="server")
    p_serve.add_argument("--rate", default=None, help="Poisson arrivals in req/s (default: all at once)")
    p_serve.add_argument("--concurrency", type=int, default=None, help="most requests in flight")
    add_workload_arguments(p_serve)
    p_serve.add_argument("--logprobs", action="store_true")
    p_serve.add_argument("--goodput-ttft-ms", type=float, default=2000.0)
    p_serve.add_argument("--goodput-tpot-ms", type=float, default=250.0)
    p_serve.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    p_lim = sub.add_parser("limits", help="matmul rate, bandwidth and decode-step floors of this machine")
    p_lim.add_argument("--model", default=None)
    p_lim.add_argument("--threads", type=int, default=2)
    p_lim.add_argument("--batch-sizes", default="1,16,32,64")
    p_cap = sub.add_parser("capacity", help="the highest request rate served within a latency SLO, against llama-server")
    capacity.add_arguments(p_cap)
    p_int = sub.add_parser("interference", help="the decoding streams' ITL while a long prompt is prefilled")
    interference.add_arguments(p_int)
    p_hol = sub.add_parser("head-of-line", help="a short request's TTFT when it arrives behind a long prompt")
    head_of_line.add_arguments(p_hol)
    p_acc = sub.add_parser("accuracy", help="perplexity and KL divergence against the float model, with llama.cpp's")
    accuracy.add_arguments(p_acc)
    args = parser.parse_args()
    if args.command == "accuracy":
        accuracy.run(args)
    elif args.command == "head-of-line":
        head_of_line.run(args)
    elif args.command == "capacity":
        capacity.run(args)
    elif args.command == "interference":
        interference.run(args)
    elif args.command == "run":
        run.run(args)
    elif args.command == "serve":
        serve(args)
    else:
        limits_cmd(args)


if __name__ == "__main__":
    main()
