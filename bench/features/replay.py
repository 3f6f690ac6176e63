"""Replay the serving benchmark's Poisson arrivals straight into an in-process engine core.

    python -m bench replay --rate 1.25                       # the balanced preset, as `conveyor serve`
    python -m bench replay --rate 1.25 --target-itl-ms 0     # no latency target: every step prefills all it can

No HTTP and no front process: TTFT and ITL are taken when a step returns, so this shows what the
scheduling policy itself gives (the serving run adds the transport on top). Same prompts, same
arrival times (seeded) as `python -m bench run`'s Poisson run; ignore_eos, greedy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench import report
from bench.serving.metrics import distribution_ms
from bench.workloads import add_workload_arguments, arrival_times, offline_workload, warmup_workload


def replay(core, requests, times: list[float]) -> dict:
    from conveyor.engine.messages import AddRequests, CoreRequest
    from conveyor.sampling_params import SamplingParams

    def add(prefix: str, batch) -> None:
        core.handle(AddRequests([CoreRequest(f"{prefix}{i}", r.prompt_token_ids,
                                             SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0),
                                             r.max_tokens, frozenset(), time.monotonic()) for i, r in batch]))

    add("warmup-", enumerate(warmup_workload(vocab_high=min(40000, core.info.vocab_size))))
    while core.has_unfinished_requests():
        core.step()
    start = time.monotonic()
    sent = 0
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    itls: list[float] = []
    while sent < len(requests) or core.has_unfinished_requests():
        now = time.monotonic() - start
        due = [(i, requests[i]) for i in range(sent, len(requests)) if times[i] <= now]
        if due:
            add("", due)
            sent += len(due)
        if not core.has_unfinished_requests():
            time.sleep(max(0.0, times[sent] - (time.monotonic() - start)))
            continue
        outputs = core.step()
        stamp = time.monotonic() - start
        for delta in outputs.deltas:
            if delta.new_token_ids:
                if delta.request_id in last:
                    itls.append(stamp - last[delta.request_id])
                else:
                    first[delta.request_id] = stamp
                last[delta.request_id] = stamp
    ttfts = [first[str(i)] - times[i] for i in range(len(requests))]
    return {"ttft_ms": distribution_ms(ttfts), "itl_ms": distribution_ms(itls),
            "duration_s": time.monotonic() - start, "max_ttft_ms": max(ttfts) * 1000}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, required=True, help="Poisson arrivals in req/s")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled SmolLM2 Q4_1 GGUF)")
    add_workload_arguments(p)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--target-itl-ms", type=float, default=None, help="default: the preset's; 0 = no target")
    p.add_argument("--batch-preset", default="balanced")
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)

    from conveyor.config import EngineConfig
    from conveyor.engine.core import EngineCore

    options = dict(model=args.model, threads=args.threads, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory="4GiB",
                   batch_preset=args.batch_preset)
    if args.target_itl_ms is not None:
        options["target_itl_ms"] = args.target_itl_ms or None
    core = EngineCore(EngineConfig.from_options(**options))
    # The bench's token range, cut to a smaller vocabulary (a test checkpoint): the same prompts as its runs.
    requests = offline_workload(args.num_requests, args.min_prompt, args.max_prompt, args.output_tokens,
                                vocab_high=min(40000, core.info.vocab_size), seed=args.seed)
    result = replay(core, requests, arrival_times(args.num_requests, args.rate, seed=args.seed))
    cost = core.cost_model.cost
    result.update(rate_req_s=args.rate, options=options,
                  step_cost={"fixed_ms": cost.fixed_s * 1e3, "per_token_ms": cost.per_token_s * 1e3,
                             "per_context_token_us": cost.per_context_token_s * 1e6})
    print(json.dumps(result, indent=1))
    report.save_run("replay", args.out_dir, result)
