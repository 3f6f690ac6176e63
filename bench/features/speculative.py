"""Speculative decoding (n-gram lookup or a draft model) on against off, on the same requests, in one run.

    python -m bench speculative                 # code-repeat requests alone and 16 at once, 64 random-token ones
    python -m bench speculative --dtype bfloat16 --batches 1,16
    python -m bench speculative --model M.gguf --quantization none --draft-model M.gguf --workloads complete \
        --batches 1 --random-requests 0 --seeded      # a draft model on code completion, greedy and seeded

The repeat workload asks the model to repeat, document or edit functions of Python's own standard
library (the `.py` files of this interpreter: real text that ships with Python), so the output
draws on the prompt. The random workload is the throughput benchmark's (random token ids), where lookups rarely
find anything: speculation must not cost there. Greedy everywhere; every request's tokens are
compared between the two runs and the mismatch count printed. Decode tok/s per request is its
tokens after the first over the time after its first token (what a streaming client sees); the
whole-run figure also counts the prompts' prefill, which speculation does not change.
"""

from __future__ import annotations

import argparse
import ast
import inspect
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


# Tasks whose answer is mostly the function itself, taken in turn.
TASKS = ("Repeat the function exactly.", "Add a docstring to this function and give the whole function back.",
         "Rename its first parameter to `value` and give the whole function back.")


def repeat_prompts(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Here is a Python function:\n\n```python\n{code}\n```\n\n"
                                         f"{TASKS[i % len(TASKS)]}"}]
            for i, code in enumerate(stdlib_functions(count))]


def complete_prompts(count: int) -> list[str]:
    """Code completion: the first half of each function (at a line end), to be continued as text."""
    prompts = []
    for code in stdlib_functions(count):
        cut = code.rfind("\n", 0, len(code) // 2)
        prompts.append(code[:cut + 1] if cut > 0 else code)
    return prompts


def run(llm, requests, output_tokens: int, chat: bool, one_at_a_time: bool,
        seed: int | None = None) -> tuple[dict, list[list[int]]]:
    from conveyor import SamplingParams

    # Seeded: the same draws with guesses as without, so the tokens must match there too.
    params = SamplingParams(temperature=0 if seed is None else 0.7, seed=seed, max_tokens=output_tokens,
                            ignore_eos=not chat)
    generate = llm.chat if chat else llm.generate
    stats = llm.engine.stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.accepted_per_position))
    started = time.perf_counter()
    if one_at_a_time:
        outputs = [generate([request], params, use_tqdm=False)[0] for request in requests]
    else:
        outputs = generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outputs)
    decode = [(len(o.token_ids) - 1) / (o.metrics.finished_s - o.metrics.first_token_s) for o in outputs
              if o.metrics and o.metrics.finished_s and o.metrics.first_token_s and len(o.token_ids) > 1]
    draft_tokens = stats.num_draft_tokens - before[1]
    accepted = stats.num_accepted_tokens - before[2]
    per_position = [n - (before[3][i] if i < len(before[3]) else 0) for i, n in enumerate(stats.accepted_per_position)]
    figures = {"output_tokens": tokens, "seconds": elapsed, "output_tokens_per_s": tokens / elapsed,
               "mean_request_decode_tokens_per_s": sum(decode) / len(decode) if decode else None,
               "drafts": stats.num_drafts - before[0], "draft_tokens": draft_tokens, "accepted_tokens": accepted,
               "accepted_per_position": per_position,
               "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0}
    return figures, [o.token_ids for o in outputs]


def best_of(runs: list[dict]) -> dict:
    """The fastest repetition (the machine is shared: slow ones met other load), with all of them listed."""
    best = max(runs, key=lambda f: f["mean_request_decode_tokens_per_s"] or 0.0)
    return {**best, "repetitions_decode_tokens_per_s": [f["mean_request_decode_tokens_per_s"] for f in runs]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16", help="repeat-workload request counts (1: --single-requests "
                                                     "requests, each alone)")
    p.add_argument("--single-requests", type=int, default=4)
    p.add_argument("--random-requests", type=int, default=64, help="random-token requests (0 = skip)")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--ngram-prompt-lookup-min", type=int, default=None, help="(default: the engine's)")
    p.add_argument("--ngram-prompt-lookup-max", type=int, default=None, help="(default: the engine's)")
    p.add_argument("--repetitions", type=int, default=2, help="runs of each side, alternating; the best counts")
    p.add_argument("--model", default=None, help="the model (default: the bundled one)")
    p.add_argument("--quantization", default="auto", help="the model's weights (none: as float, --dtype)")
    p.add_argument("--draft-model", default=None, help="speculate with this draft model instead of n-grams")
    p.add_argument("--draft-quantization", default="auto")
    p.add_argument("--workloads", default="repeat", help="repeat (chat: repeat/edit a function) and/or complete "
                                                         "(continue half a function as text), comma-separated")
    p.add_argument("--seeded", action="store_true", help="also run each workload with seeded sampling")
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)
    # No prefix caching: a repetition must not find the previous one's prompts cached.
    base = {"threads": args.threads, "dtype": args.dtype, "kv_cache_memory": "4GiB", "max_num_seqs": 64,
            "enable_prefix_caching": False, "quantization": args.quantization}
    if args.draft_model:
        spec = {"speculative_model": args.draft_model, "speculative_model_quantization": args.draft_quantization,
                "num_speculative_tokens": args.num_speculative_tokens}
    else:
        spec = {"speculative": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                **{name: getattr(args, name) for name in ("ngram_prompt_lookup_min", "ngram_prompt_lookup_max")
                   if getattr(args, name) is not None}}
    print(f"CPU: {report.machine()}", flush=True)
    makers = {"repeat": (repeat_prompts, True), "complete": (complete_prompts, False)}
    workloads = [(f"{kind}-{n}{'-seeded' if seed is not None else ''}",
                  makers[kind][0](args.single_requests if n == 1 else n), makers[kind][1], n == 1, seed)
                 for kind in args.workloads.split(",") for n in map(int, args.batches.split(","))
                 for seed in ([None, 1234] if args.seeded else [None])]
    if args.random_requests:
        workloads.append((f"random-{args.random_requests}", [r.prompt_token_ids for r in
                                                             offline_workload(args.random_requests)], False, False,
                          None))
    from conveyor import LLM, SamplingParams

    # Both engines live side by side and take turns, so a slow spell of the machine hits both alike.
    engines = {"off": LLM(args.model, **base), "on": LLM(args.model, **base, **spec)}
    for llm in engines.values():
        llm.generate([[100, 101, 102]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)   # warm-up
    results = {}
    for name, requests, chat, one_at_a_time, seed in workloads:
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        token_ids: dict[str, list[list[int]]] = {}
        for rep in range(args.repetitions):
            for side in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                figures, token_ids[side] = run(engines[side], requests, args.output_tokens, chat, one_at_a_time,
                                               seed)
                runs[side].append(figures)
        off, on = best_of(runs["off"]), best_of(runs["on"])
        mismatches = sum(a != b for a, b in zip(token_ids["off"], token_ids["on"]))
        ratio = on["output_tokens_per_s"] / off["output_tokens_per_s"]
        decode_ratio = on["mean_request_decode_tokens_per_s"] / off["mean_request_decode_tokens_per_s"]
        results[name] = {"off": off, "on": on, "ratio": ratio, "decode_ratio": decode_ratio,
                         "mismatches": mismatches, "num_requests": len(requests)}
        print(f"{name:10s} decode per request: off {off['mean_request_decode_tokens_per_s']:6.1f} tok/s, on "
              f"{on['mean_request_decode_tokens_per_s']:6.1f} tok/s, {decode_ratio:.2f}x | whole run (prefill too): "
              f"{off['output_tokens_per_s']:6.1f} -> {on['output_tokens_per_s']:6.1f} tok/s, {ratio:.2f}x | "
              f"acceptance {on['acceptance_rate']:.2f} ({on['accepted_tokens']}/{on['draft_tokens']}) | "
              f"mismatches={mismatches}", flush=True)
    report.save_run("speculative", args.out_dir, {"options": {**base, **spec, "model": args.model},
                                                  "output_tokens": args.output_tokens,
                                                  "results": results})
