"""What a draft token costs: one step's time with 0..k guesses per request, at 1 and 16 requests.

    python -m bench draft-cost [--dtype float32] [--context 600] [--drafts 0,1,2,4]

Times ModelRunner.execute on the bundled model (best of --repetitions) for decode rows that each
carry the same number of draft tokens, at context length --context. Speculation pays only while a
verified guess costs much less than a decode row: at one request the step reads all the weights
and guesses are nearly free; at 16 requests on a few cores every token is compute, and the table
shows the ceiling: (1 + accepted guesses) tokens per request over the step time with its guesses.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench draft-cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=600, help="tokens already in each request's cache")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--drafts", default="0,1,2,4", help="guesses per request")
    p.add_argument("--repetitions", type=int, default=10)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)
    from conveyor.config import EngineConfig
    from conveyor.core.plan import ScheduledRow, StepPlan
    from conveyor.front.llm_engine import LLMEngine

    print(f"CPU: {report.machine()}", flush=True)
    engine = LLMEngine(EngineConfig.from_options(model=None, dtype=args.dtype, threads=args.threads,
                                                 kv_cache_memory="1GiB", enable_prefix_caching=False))
    runner, block_size = engine.core.runner, engine.core.kv_cache.block_size
    drafts = [int(d) for d in args.drafts.split(",")]
    blocks_per_row = -(-(args.context + max(drafts) + 1) // block_size)
    results: dict[str, dict[str, float]] = {}
    for batch in map(int, args.batches.split(",")):
        for k in drafts:
            # The KV of these blocks is whatever the cache holds: timing does not depend on it.
            rows = tuple(ScheduledRow(f"r{b}", [100 + i for i in range(k + 1)], args.context,
                                      list(range(b * blocks_per_row, (b + 1) * blocks_per_row)), True, False, k)
                         for b in range(batch))
            times = []
            for _ in range(args.repetitions):
                started = time.perf_counter()
                runner.execute(StepPlan(rows))
                times.append(time.perf_counter() - started)
            best = min(times)
            results.setdefault(f"batch-{batch}", {})[f"drafts-{k}"] = best
            base = results[f"batch-{batch}"]["drafts-0"] if k else best
            per_guess = (best - base) / (batch * k) if k else 0.0
            print(f"{batch:3d} requests, {k} guesses each: {best * 1e3:7.2f} ms"
                  + (f" (+{per_guess * 1e3:.2f} ms per guess)" if k else ""), flush=True)
    report.save_run("draft-cost", args.out_dir, {"options": vars(args) | {"out_dir": str(args.out_dir)},
                                                 "step_seconds": results})
