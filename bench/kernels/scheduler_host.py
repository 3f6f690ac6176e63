"""The scheduler's host time per decode step, without a model: what a GPU step pays in Python before and after
its kernels.

    python -m bench scheduler-host --rows 64,256 --context 200,2000

N requests of --context prompt tokens are admitted and prefilled (plan and update only), then --steps decode
steps are timed: `schedule()` and `update()` each, in ms per step. Pure Python, any machine.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import report
from conveyor.config import SchedulerConfig
from conveyor.core.block_manager import BlockManager
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler
from conveyor.sampling_params import SamplingParams

BLOCK_SIZE = 16


def measure(num_rows: int, context: int, steps: int) -> tuple[float, float]:
    """(schedule ms, update ms) per decode step of `num_rows` rows at about `context` tokens each."""
    max_tokens = steps + 8
    blocks = BlockManager(num_rows * ((context + max_tokens) // BLOCK_SIZE + 2), BLOCK_SIZE, True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=num_rows, max_num_batched_tokens=8192), blocks,
                          context + max_tokens + 1)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_rows):   # distinct prompts: no prefix is shared
        prompt = [3 + (i * 7919 + j) % 30000 for j in range(context)]
        scheduler.add(Request(request_id=f"r{i}", prompt_token_ids=prompt, params=params, arrival_s=0.0,
                              max_tokens=max_tokens))
    while True:   # prefill: every row decodes after this
        plan = scheduler.schedule()
        scheduler.update(plan, [[5]] * sum(row.is_sampling for row in plan.rows))
        if len(plan.rows) == num_rows and not any(row.is_prefill for row in plan.rows):
            break
    schedule_s = update_s = 0.0
    for step in range(steps):
        started = time.perf_counter()
        plan = scheduler.schedule()
        planned = time.perf_counter()
        scheduler.update(plan, [[6 + step]] * len(plan.rows))
        schedule_s += planned - started
        update_s += time.perf_counter() - planned
    return 1000 * schedule_s / steps, 1000 * update_s / steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench scheduler-host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256", help="comma list of decode rows per step")
    p.add_argument("--context", default="200,2000", help="comma list of prompt lengths")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)
    results = []
    print(f"{'rows':>5s} {'context':>8s} {'schedule ms':>12s} {'update ms':>10s}")
    for context in (int(c) for c in args.context.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            schedule_ms, update_ms = measure(rows, context, args.steps)
            print(f"{rows:5d} {context:8d} {schedule_ms:12.3f} {update_ms:10.3f}", flush=True)
            results.append({"rows": rows, "context": context, "schedule_ms": schedule_ms, "update_ms": update_ms})
    report.save_run("scheduler-host", args.out_dir, {"steps": args.steps, "results": results})
