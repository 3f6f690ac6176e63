"""Decode on a CUDA GPU: eager steps against steps replayed from CUDA graphs, in one run.

    python -m bench.cuda_decode [--model FILE] [--requests 1,16,64,256] [--tokens 128]

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


def measure(model: str | None, eager: bool, sizes: list[int], prompt_tokens: int, tokens: int,
            vocab_high: int) -> dict:
    import torch

    from conveyor import LLM, SamplingParams

    llm = LLM(model, device="cuda", max_num_seqs=max(sizes), kv_cache_memory="8GiB", enforce_eager=eager)
    prompts = [[100 + (i * 7919 + j * 31) % (vocab_high - 100) for j in range(prompt_tokens)]
               for i in range(max(sizes))]
    out: dict = {"by_requests": {}}
    for n in sizes:
        llm.generate(prompts[:n], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        torch.cuda.synchronize()
        started = time.perf_counter()
        outputs = llm.generate(prompts[:n], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
        out["by_requests"][n] = {"tok_s": n * tokens / wall, "ms_per_step": 1000 * wall / tokens,
                                 "tokens": [o.token_ids for o in outputs]}
        print(f"{'eager' if eager else 'graphs':6s} {n:4d} at once: {n * tokens / wall:9.1f} tok/s, "
              f"{1000 * wall / tokens:6.2f} ms per step", flush=True)
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        out["graphs_captured"] = sorted(graphs.graphs)
        out["graphs_failed"] = graphs.failed
    out["dtype"] = str(llm.engine.core.dtype).removeprefix("torch.")
    del llm
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cuda_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file or Hugging Face folder (default: the bundled model)")
    p.add_argument("--requests", default="1,16,64,256", help="comma list of requests at once")
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args()
    from bench.limits import model_arch

    sizes = [int(n) for n in args.requests.split(",")]
    vocab_high = min(32_000, model_arch(args.model).vocab_size)
    runs = {name: measure(args.model, name == "eager", sizes, args.prompt_tokens, args.tokens, vocab_high)
            for name in ("eager", "graphs")}
    summary = {}
    for n in sizes:
        eager, graphs = runs["eager"]["by_requests"][n], runs["graphs"]["by_requests"][n]
        same = sum(a == b for a, b in zip(eager["tokens"], graphs["tokens"]))
        summary[n] = {"eager_tok_s": eager["tok_s"], "graphs_tok_s": graphs["tok_s"],
                      "graphs_over_eager": graphs["tok_s"] / eager["tok_s"], "identical_greedy": f"{same}/{n}"}
        print(f"{n:4d} at once: graphs / eager {graphs['tok_s'] / eager['tok_s']:.2f}x, "
              f"greedy sequences identical {same}/{n}", flush=True)
    for run in runs.values():   # the sequences served the comparison above; the JSON keeps its counts
        for fig in run["by_requests"].values():
            del fig["tokens"]
    report.save_run("cuda-decode", args.out_dir, {
        "model": args.model or "bundled", "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
        "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
