"""Offline throughput and single-request decode: conveyor vs transformers, same weights, one run.

    python -m bench.offline --num-requests 64 --systems conveyor,conveyor-sequential,hf-sequential
    python -m bench.offline --single --dtypes float32,bfloat16

Prints a table of ratios to conveyor and writes every figure with the command to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from bench.workloads import OfflineRequest, offline_workload

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run_conveyor(requests: list[OfflineRequest], dtype: str, threads: int, sequential: bool) -> dict:
    from conveyor import LLM, SamplingParams

    llm = LLM(dtype=dtype, threads=threads, max_num_seqs=64 if not sequential else 1,
              max_num_batched_tokens=512, kv_cache_memory="4GiB")
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)   # warm-up
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    prompts = [r.prompt_token_ids for r in requests]
    start = time.perf_counter()
    if sequential:
        outs = [llm.generate([p], s, use_tqdm=False)[0] for p, s in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats
    return {"elapsed_s": elapsed, "output_tokens": sum(len(o.token_ids) for o in outs),
            "decode_tokens_per_s_steps": stats.decode_tokens_per_s,
            "prefill_tokens_per_s_steps": stats.prefill_tokens_per_s,
            "avg_rows_per_step": stats.avg_rows_per_step}


def load_hf(dtype: str):
    from transformers import AutoModelForCausalLM

    from conveyor.model.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=DTYPES[dtype])
    return model.eval()


def run_hf_sequential(requests: list[OfflineRequest], dtype: str, threads: int) -> dict:
    torch.set_num_threads(threads)
    model = load_hf(dtype)
    total = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for r in requests:
            ids = torch.tensor([r.prompt_token_ids])
            out = model.generate(ids, max_new_tokens=r.max_tokens, min_new_tokens=r.max_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(ids))
            total += out.shape[1] - ids.shape[1]
    return {"elapsed_s": time.perf_counter() - start, "output_tokens": total}


def single_decode_conveyor(dtype: str, threads: int, new_tokens: int) -> float:
    from conveyor import LLM, SamplingParams

    llm = LLM(dtype=dtype, threads=threads, max_num_seqs=1, kv_cache_memory="256MiB")
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a long story about a lighthouse."}]), add_special_tokens=False)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    return (len(out.token_ids) - 1) / (m.finished_s - m.first_token_s)


def single_decode_hf(dtype: str, threads: int, new_tokens: int) -> float:
    torch.set_num_threads(threads)
    model = load_hf(dtype)
    ids = torch.tensor([[1, 9690, 198, 10576, 549, 253, 986, 1994, 563, 253, 2]])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False)
        total = time.perf_counter() - start
    return (new_tokens - 1) / (total - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--single", action="store_true", help="single-request decode speed instead of throughput")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--systems", default="conveyor,conveyor-sequential,hf-sequential")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/offline.json")
    args = parser.parse_args()

    results: dict = {"command": " ".join(["python -m bench.offline", *sys.argv[1:]]),
                     "machine": platform.platform(), "cpus": torch.get_num_threads(),
                     "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "figures": {}}
    if args.single:
        for dtype in args.dtypes.split(","):
            ours = single_decode_conveyor(dtype, args.threads, args.output_tokens)
            theirs = single_decode_hf(dtype, args.threads, args.output_tokens)
            results["figures"][dtype] = {"conveyor_tok_s": ours, "transformers_tok_s": theirs,
                                         "ratio": ours / theirs}
            print(f"{dtype:9s} single-request decode: conveyor {ours:6.1f} tok/s, transformers generate "
                  f"{theirs:6.1f} tok/s, ratio {ours / theirs:.2f}x", flush=True)
    else:
        requests = offline_workload(args.num_requests, output_tokens=args.output_tokens)
        for dtype in args.dtypes.split(","):
            for system in args.systems.split(","):
                if system == "conveyor":
                    fig = run_conveyor(requests, dtype, args.threads, sequential=False)
                elif system == "conveyor-sequential":
                    fig = run_conveyor(requests, dtype, args.threads, sequential=True)
                elif system == "hf-sequential":
                    fig = run_hf_sequential(requests, dtype, args.threads)
                else:
                    raise SystemExit(f"unknown system {system}")
                fig["output_tokens_per_s"] = fig["output_tokens"] / fig["elapsed_s"]
                results["figures"][f"{system}/{dtype}"] = fig
                print(f"{system:20s} {dtype:9s} {fig['output_tokens_per_s']:8.1f} output tok/s "
                      f"({fig['output_tokens']} tokens in {fig['elapsed_s']:.1f} s)", flush=True)
            base = results["figures"].get(f"conveyor/{dtype}")
            if base:
                for key, fig in results["figures"].items():
                    if key.endswith(dtype):
                        fig["ratio_conveyor_to_this"] = base["output_tokens_per_s"] / fig["output_tokens_per_s"]
                        print(f"conveyor/{dtype} vs {key}: {fig['ratio_conveyor_to_this']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
