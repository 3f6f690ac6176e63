"""Decode on a CUDA GPU: eager steps against steps replayed from CUDA graphs, in one run.

    python -m bench cuda-decode [--model FILE] [--requests 1,16,64,256] [--tokens 128]

Offline `LLM.generate` with `device="cuda"` (bfloat16, conveyor's defaults), once with
`enforce_eager=True` and once with graphs: per batch size, a warm-up (which captures the graphs it
needs), then N requests of --prompt-tokens token ids and --tokens output tokens each (ignore_eos),
timed with the GPU synchronised. Prints tok/s, ms per step (prefill included), the ratio, and how
many greedy sequences are identical between the two modes; JSON to --out-dir.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import report
from bench.workloads import fixed_workload


def measure(model: str | None, label: str, sizes: list[int], prompt_tokens: int, tokens: int,
            vocab_high: int, **options: object) -> dict:
    """One engine (`options` on top of the GPU defaults): per batch size, a warm-up then the timed run."""
    import torch

    from conveyor import LLM, SamplingParams

    llm = LLM(model, **{"device": "cuda", "max_num_seqs": max(sizes), "kv_cache_memory": "8GiB", **options})
    core = llm.engine.core
    out: dict = {"weights": core.info.weights, "by_requests": {},
                 "weight_bytes": sum(t.nbytes for t in (*core.model.parameters(), *core.model.buffers()))}
    print(f"{label:6s} weights {out['weights']}: {out['weight_bytes'] / 2**20:.1f} MiB", flush=True)
    prompts = [r.prompt_token_ids for r in fixed_workload(max(sizes), prompt_tokens, tokens, vocab_high)]
    for n in sizes:
        llm.generate(prompts[:n], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        torch.cuda.synchronize()
        started = time.perf_counter()
        outputs = llm.generate(prompts[:n], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
        out["by_requests"][n] = {"tok_s": n * tokens / wall, "ms_per_step": 1000 * wall / tokens,
                                 "tokens": [o.token_ids for o in outputs]}
        print(f"{label:6s} {n:4d} at once: {n * tokens / wall:9.1f} tok/s, "
              f"{1000 * wall / tokens:6.2f} ms per step", flush=True)
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        out["graphs_captured"] = sorted(graphs.graphs)
        out["graphs_failed"] = graphs.failed
    out["dtype"] = str(llm.engine.core.dtype).removeprefix("torch.")
    del llm, core
    torch.cuda.empty_cache()
    return out


def compare(runs: dict[str, dict], base: str, other: str, sizes: list[int]) -> dict:
    """Per batch size: both tok/s, their ratio, and how many greedy sequences are identical; then drops
    the sequences from `runs` (the JSON keeps the counts)."""
    summary = {}
    for n in sizes:
        a, b = runs[base]["by_requests"][n], runs[other]["by_requests"][n]
        same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
        summary[n] = {f"{base}_tok_s": a["tok_s"], f"{other}_tok_s": b["tok_s"],
                      f"{other}_over_{base}": b["tok_s"] / a["tok_s"], "identical_greedy": f"{same}/{n}"}
        print(f"{n:4d} at once: {other} / {base} {b['tok_s'] / a['tok_s']:.2f}x, "
              f"greedy sequences identical {same}/{n}", flush=True)
    for run in runs.values():
        for fig in run["by_requests"].values():
            fig.pop("tokens", None)
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench cuda-decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file or Hugging Face folder (default: the bundled model)")
    p.add_argument("--requests", default="1,16,64,256", help="comma list of requests at once")
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)
    from bench.kernels.limits import model_arch

    sizes = [int(n) for n in args.requests.split(",")]
    vocab_high = min(32_000, model_arch(args.model).vocab_size)
    runs = {name: measure(args.model, name, sizes, args.prompt_tokens, args.tokens, vocab_high,
                          enforce_eager=name == "eager")
            for name in ("eager", "graphs")}
    summary = compare(runs, "eager", "graphs", sizes)
    report.save_run("cuda-decode", args.out_dir, {
        "model": args.model or "bundled", "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
        "summary": summary, "runs": runs})
