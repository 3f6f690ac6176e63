"""What tensor parallelism costs on this machine: the bundled model with 2 ranks against 1, one run.

    python -m bench tensor-parallel [--requests 1,16] [--output-tokens 64] [--dtype auto]

Both engines use the same cores (2 ranks of threads/2 each against one rank of all threads) and
take turns, best of the repetitions. One request measures decode (tokens after the first over the
time after the first); 16 at once measure throughput. Greedy outputs are compared and the count of
requests whose tokens differ printed (float32 should give 0; bfloat16 sums in another order).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import report
from bench.workloads import offline_workload


def run(llm, prompts: list[list[int]], output_tokens: int) -> tuple[dict, list[list[int]]]:
    from conveyor import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    decode = [(len(o.outputs[0].token_ids) - 1) / (o.metrics.finished_s - o.metrics.first_token_s)
              for o in outputs if o.metrics and o.metrics.finished_s and o.metrics.first_token_s]
    return ({"output_tokens_per_s": tokens / elapsed, "seconds": elapsed,
             "mean_request_decode_tokens_per_s": sum(decode) / len(decode)},
            [o.outputs[0].token_ids for o in outputs])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench tensor-parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default="1,16", help="request counts, each a run")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2, help="cores for either side")
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)
    from conveyor import LLM

    print(f"CPU: {report.machine()}", flush=True)
    base = {"dtype": args.dtype, "threads": args.threads, "kv_cache_memory": "1GiB", "enable_prefix_caching": False}
    engines = {"tp1": LLM(None, **base), "tp2": LLM(None, **base, tensor_parallel_size=2)}
    results = {}
    for count in map(int, args.requests.split(",")):
        prompts = [r.prompt_token_ids for r in offline_workload(count)]
        best: dict[str, dict] = {}
        tokens: dict[str, list[list[int]]] = {}
        for rep in range(args.repetitions):
            for side in (("tp1", "tp2") if rep % 2 == 0 else ("tp2", "tp1")):
                figures, tokens[side] = run(engines[side], prompts, args.output_tokens)
                if side not in best or figures["output_tokens_per_s"] > best[side]["output_tokens_per_s"]:
                    best[side] = figures
        mismatches = sum(a != b for a, b in zip(tokens["tp1"], tokens["tp2"]))
        ratio = best["tp2"]["output_tokens_per_s"] / best["tp1"]["output_tokens_per_s"]
        decode = best["tp2"]["mean_request_decode_tokens_per_s"] / best["tp1"]["mean_request_decode_tokens_per_s"]
        results[f"requests-{count}"] = {**best, "ratio": ratio, "decode_ratio": decode, "mismatches": mismatches}
        print(f"{count:3d} requests: 1 rank {best['tp1']['output_tokens_per_s']:6.1f} tok/s, 2 ranks "
              f"{best['tp2']['output_tokens_per_s']:6.1f} tok/s ({ratio:.2f}x; per-request decode {decode:.2f}x) | "
              f"mismatches={mismatches}", flush=True)
    for llm in engines.values():
        llm.engine.core.close()
    report.save_run("tensor-parallel", args.out_dir, {"options": base, "output_tokens": args.output_tokens,
                                                      "results": results})
