"""A GGUF file on a CUDA GPU: kept in its own formats against dequantized to bfloat16 at load, in one run.

    python -m bench cuda-gguf [--model FILE] [--requests 1,64] [--tokens 64]

Offline `LLM.generate` with `device="cuda"` (bfloat16, CUDA graphs), once with `quantization="none"`
(today's bfloat16 weights) and once with `"gguf"` (the file's blocks; the fused Triton kernel where it
is installed): the bytes the model holds, then per batch size a warm-up and N requests of
--prompt-tokens token ids and --tokens output tokens each (ignore_eos), timed with the GPU
synchronised. Prints tok/s, ms per step, the ratio and how many greedy sequences are identical; JSON
to --out-dir.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import report
from bench.gpu.cuda_decode import compare, measure


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench cuda-gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file (default: the bundled model)")
    p.add_argument("--requests", default="1,64", help="comma list of requests at once")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)
    from bench.kernels.limits import model_arch
    from conveyor.model.gguf import gpu_matmul

    sizes = [int(n) for n in args.requests.split(",")]
    vocab_high = min(32_000, model_arch(args.model).vocab_size)
    runs = {name: measure(args.model, name, sizes, args.prompt_tokens, args.tokens, vocab_high,
                          quantization="none" if name == "bf16" else "gguf", kv_cache_memory="4GiB")
            for name in ("bf16", "kept")}
    summary = compare(runs, "bf16", "kept", sizes)
    report.save_run("cuda-gguf", args.out_dir, {
        "model": args.model or "bundled", "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
        "triton": gpu_matmul.available(), "summary": summary, "runs": runs})
