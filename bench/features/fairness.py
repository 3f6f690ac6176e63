"""Fair sharing between tenants: one tenant's burst against another's single request, in one run.

    python -m bench fairness                    # A: 100 requests at once; B: 1 request a second later

Tenant A submits --burst requests at once; a second later tenant B submits one. With fair sharing
B's request is admitted at the next free batch slot; without it (B counted as the same tenant as
A, which is first come, first served) it waits behind A's whole backlog. Reported: B's time to
first token, and A's output tokens per second over its burst, both ways, each the best of
--repetitions (the two modes take turns). --max-num-seqs is below the burst, so there is a backlog.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from bench import report


def run(engine, burst: int, prompt_len: int, output_tokens: int, fair: bool, seed: int) -> dict:
    from conveyor import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    started = time.perf_counter()
    for i in range(burst):
        engine.add_request([rng.randrange(100, 40000) for _ in range(prompt_len)], params,
                           request_id=f"a{i}-{seed}", tenant="A")
    b_id, b_added, b_first = f"b-{seed}", None, None
    a_tokens, a_done, finished = 0, 0, 0
    while finished < burst + 1:
        if b_added is None and time.perf_counter() - started >= 1.0:
            b_added = time.perf_counter()
            engine.add_request([rng.randrange(100, 40000) for _ in range(prompt_len)], params, request_id=b_id,
                               tenant="B" if fair else "A")
        for output in engine.step():
            if output.request_id == b_id:
                if b_first is None and output.new_token_ids:
                    b_first = time.perf_counter()
            else:
                a_tokens += len(output.new_token_ids)
                if output.finished:
                    a_done = time.perf_counter()
            finished += output.finished
    return {"b_ttft_s": b_first - b_added, "a_output_tokens": a_tokens, "a_seconds": a_done - started,
            "a_output_tokens_per_s": a_tokens / (a_done - started)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench fairness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--burst", type=int, default=100)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)
    options = {"threads": args.threads, "dtype": args.dtype, "kv_cache_memory": "2GiB",
               "max_num_seqs": args.max_num_seqs, "enable_prefix_caching": False}
    print(f"CPU: {report.machine()}", flush=True)
    from conveyor import LLM, SamplingParams

    llm = LLM(None, **options)
    llm.generate([[100, 101, 102]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)   # warm-up
    runs: dict[str, list[dict]] = {"fcfs": [], "fair": []}
    for rep in range(args.repetitions):
        for mode in (("fcfs", "fair") if rep % 2 == 0 else ("fair", "fcfs")):
            figures = run(llm.engine, args.burst, args.prompt_tokens, args.output_tokens, mode == "fair", seed=rep)
            runs[mode].append(figures)
            print(f"{mode}: B's TTFT {figures['b_ttft_s'] * 1e3:.0f} ms, A {figures['a_output_tokens_per_s']:.1f} "
                  f"tok/s", flush=True)
    best = {mode: {"b_ttft_s": min(f["b_ttft_s"] for f in figures),
                   "a_output_tokens_per_s": max(f["a_output_tokens_per_s"] for f in figures)}
            for mode, figures in runs.items()}
    ratio = best["fair"]["a_output_tokens_per_s"] / best["fcfs"]["a_output_tokens_per_s"]
    print(f"B's time to first token: {best['fcfs']['b_ttft_s']:.2f} s first come first served, "
          f"{best['fair']['b_ttft_s']:.2f} s fair; A's throughput fair / fcfs: {ratio:.3f}x")
    report.save_run("fairness", args.out_dir, {"options": options, "burst": args.burst,
                                               "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                                               "runs": runs, "best": best, "a_throughput_ratio": ratio})
