"""Two focused comparisons with transformers, each in one run, same weights:

    python -m bench compare single --dtypes float32,bfloat16
        single-request decode tokens/s: conveyor vs transformers `generate`
    python -m bench compare one-by-one --num-requests 64 --sequential-requests 16
        output tokens/s of the offline workload run together through conveyor, against the same
        requests one at a time through conveyor and through transformers `generate`. One-at-a-time
        rates are measured on the first --sequential-requests requests (tokens/s does not depend on
        how many run in sequence) and reported as such.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import report
from bench.peers import conveyor_offline, hf_peers
from bench.workloads import OfflineRequest, offline_workload, warmup_workload


def hf_single_decode(model, prompt: list[int], new_tokens: int) -> float:
    """Decode tokens/s of `generate`, the first token (prefill) subtracted."""
    import torch

    ids = torch.tensor([prompt])

    def timed(n: int) -> float:
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    with torch.inference_mode():
        timed(4)
        return (new_tokens - 1) / (timed(new_tokens) - timed(1))


def single(args: argparse.Namespace, model_path: Path) -> dict:
    figures = {}
    for dtype in args.dtypes.split(","):
        llm = conveyor_offline.make_llm(None, args.threads, 1, 512, "256MiB", dtype)
        prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Tell me a long story about a lighthouse."}]), add_special_tokens=False)
        request = OfflineRequest(prompt, args.output_tokens)
        conveyor_offline.single_stream_decode(llm, [OfflineRequest(prompt, 4)])   # warm-up
        ours = conveyor_offline.single_stream_decode(llm, [request])["decode_tokens_per_s"]
        del llm
        theirs = hf_single_decode(hf_peers.load(model_path, args.threads, dtype), prompt, args.output_tokens)
        figures[dtype] = {"conveyor_tok_s": ours, "transformers_tok_s": theirs, "ratio": ours / theirs}
        print(f"{dtype:9s} single-request decode: conveyor {ours:6.1f} tok/s, transformers {theirs:6.1f} tok/s "
              f"-> {ours / theirs:.2f}x", flush=True)
    return figures


def one_by_one(args: argparse.Namespace, model_path: Path) -> dict:
    requests = offline_workload(args.num_requests, output_tokens=args.output_tokens)
    subset = requests[: args.sequential_requests]
    warm = warmup_workload()
    llm = conveyor_offline.make_llm(None, args.threads, args.num_requests, args.max_num_batched_tokens, "4GiB")
    together = conveyor_offline.run(llm, requests, warm)
    start, tokens = time.perf_counter(), 0
    for r in subset:
        tokens += conveyor_offline.run(llm, [r], [])["output_tokens"]
    alone = {"elapsed_s": time.perf_counter() - start, "output_tokens": tokens}
    del llm
    hf = hf_peers.run_sequential(hf_peers.load(model_path, args.threads), subset, warm)
    figures = {}
    for name, fig in (("conveyor together", together), ("conveyor one at a time", alone),
                      ("transformers generate one at a time", hf)):
        figures[name] = {"output_tokens": fig["output_tokens"], "elapsed_s": fig["elapsed_s"],
                         "output_tokens_per_s": fig["output_tokens"] / fig["elapsed_s"]}
    base = figures["conveyor together"]["output_tokens_per_s"]
    for name, fig in figures.items():
        fig["conveyor_together_ratio"] = base / fig["output_tokens_per_s"]
        print(f"{name:38s} {fig['output_tokens_per_s']:7.1f} output tok/s  (conveyor together is "
              f"{fig['conveyor_together_ratio']:.2f}x)", flush=True)
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("single", "one-by-one"))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--sequential-requests", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = parser.parse_args(argv)
    from conveyor.model.checkpoint import default_model_path

    model_path = default_model_path()
    figures = single(args, model_path) if args.mode == "single" else one_by_one(args, model_path)
    report.save_run(f"compare-{args.mode}", args.out_dir, {"mode": args.mode, "figures": figures})
