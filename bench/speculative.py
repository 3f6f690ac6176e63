"""Speculative decoding (n-gram lookup) on against off, on the same requests, in one run.

    python -m bench.speculative                 # 1 and 16 code-repeat requests, 64 random-token requests
    python -m bench.speculative --dtype bfloat16 --batches 1,16

The repeat workload asks the model to give back functions of Python's own standard library (the
`.py` files of this interpreter: real text that ships with Python), so the output draws on the
prompt. The random workload is the throughput benchmark's (random token ids), where lookups rarely
find anything: speculation must not cost there. Greedy everywhere; every request's tokens are
compared between the two runs and the mismatch count printed.
"""

from __future__ import annotations

import argparse
import ast
import gc
import inspect
import sys
import time
from pathlib import Path

from bench import report
from bench.workloads import offline_workload

STDLIB_MODULES = ("textwrap", "json.decoder", "json.encoder", "shlex", "fnmatch", "base64", "calendar",
                  "difflib", "heapq", "bisect", "colorsys", "string", "csv", "glob", "ntpath", "posixpath")


def stdlib_functions(count: int, min_chars: int = 400, max_chars: int = 1200) -> list[str]:
    """Source of `count` module-level functions from the standard library, in a fixed order."""
    import importlib

    found = []
    for name in STDLIB_MODULES:
        source = inspect.getsource(importlib.import_module(name))
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                text = ast.get_source_segment(source, node)
                if text and min_chars <= len(text) <= max_chars:
                    found.append(text)
    if len(found) < count:
        raise RuntimeError(f"only {len(found)} standard-library functions of the wanted size")
    return found[:count]


def repeat_prompts(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Here is a Python function:\n\n```python\n{code}\n```\n\n"
                                         "Repeat the function exactly, adding a docstring if it has none."}]
            for code in stdlib_functions(count)]


def run(options: dict, requests, output_tokens: int, chat: bool) -> dict:
    from conveyor import LLM, SamplingParams

    llm = LLM(None, **options)
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=not chat)
    generate = llm.chat if chat else llm.generate
    generate(requests[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)     # warm-up
    started = time.perf_counter()
    outputs = generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    stats = llm.engine.stats
    tokens = sum(len(o.token_ids) for o in outputs)
    decode = [(len(o.token_ids) - 1) / (o.metrics.finished_s - o.metrics.first_token_s) for o in outputs
              if o.metrics and o.metrics.finished_s and o.metrics.first_token_s and len(o.token_ids) > 1]
    figures = {"output_tokens": tokens, "seconds": elapsed, "output_tokens_per_s": tokens / elapsed,
               "mean_request_decode_tokens_per_s": sum(decode) / len(decode) if decode else None,
               "drafts": stats.num_drafts, "draft_tokens": stats.num_draft_tokens,
               "accepted_tokens": stats.num_accepted_tokens, "accepted_per_position": stats.accepted_per_position,
               "acceptance_rate": stats.draft_acceptance_rate}
    token_ids = [o.token_ids for o in outputs]
    del llm
    gc.collect()
    return figures, token_ids


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16", help="repeat-workload request counts")
    p.add_argument("--random-requests", type=int, default=64, help="random-token requests (0 = skip)")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    base = {"threads": args.threads, "dtype": args.dtype, "kv_cache_memory": "4GiB", "max_num_seqs": 64}
    spec = {"speculative": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    print(f"CPU: {report.machine()}", flush=True)
    workloads = [(f"repeat-{n}", repeat_prompts(n), True) for n in map(int, args.batches.split(","))]
    if args.random_requests:
        workloads.append((f"random-{args.random_requests}", [r.prompt_token_ids for r in
                                                             offline_workload(args.random_requests)], False))
    results = {}
    for name, requests, chat in workloads:
        off, off_ids = run(base, requests, args.output_tokens, chat)
        on, on_ids = run({**base, **spec}, requests, args.output_tokens, chat)
        mismatches = sum(a != b for a, b in zip(off_ids, on_ids))
        ratio = on["output_tokens_per_s"] / off["output_tokens_per_s"]
        results[name] = {"off": off, "on": on, "ratio": ratio, "mismatches": mismatches,
                         "num_requests": len(requests)}
        print(f"{name:10s} off {off['output_tokens_per_s']:6.1f} tok/s  on {on['output_tokens_per_s']:6.1f} tok/s  "
              f"{ratio:.2f}x  acceptance {on['acceptance_rate']:.2f} ({on['accepted_tokens']}/{on['draft_tokens']})  "
              f"mismatches={mismatches}", flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"speculative-{stamp}.json"
    report.write_json(out, {"command": "python -m bench.speculative " + " ".join(sys.argv[1:]),
                            "machine": report.machine(), "versions": report.versions(None),
                            "options": {**base, **spec}, "output_tokens": args.output_tokens, "results": results})
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
