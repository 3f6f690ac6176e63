"""Decode attention per step: SDPA over gathered blocks against FlexAttention reading the blocks in place.

    python -m bench flex-attention [--rows 64] [--contexts 256,4096] [--device cuda]

One decode step's attention over every layer (--shape: heads, kv heads, head dim, layers; SmolLM2-135M's
by default) for --rows rows, each layer with its own cache (so no layer reads another's keys from the
GPU's L2), in --dtype. Cases: every row at each of --contexts, then "mixed": one row at the longest,
the others at the shortest. Per backend and case: milliseconds per step for the attention calls (the
GPU synchronised; the median of --repeats timed steps after warm-up, the first FlexAttention call
compiling), and for building the step's metadata on the host; the largest difference between the two
backends' outputs. A backend whose cost follows the tokens attended takes about 16x longer at 4096
than at 256, and "mixed" costs it about what the shortest case does (SDPA pads every row to the
longest); JSON to --out-dir.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench import report
from conveyor.model.attention import RowSpec, attend, build_metadata


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(contexts: list[int], shape: tuple[int, int, int, int], block_size: int, dtype: torch.dtype,
            device: torch.device, repeats: int) -> dict:
    """contexts: one per row, in tokens."""
    num_heads, num_kv_heads, head_dim, num_layers = shape
    rows = len(contexts)
    counts = [-(-c // block_size) for c in contexts]
    num_blocks = sum(counts)
    gen = torch.Generator(device=device).manual_seed(0)
    caches = [(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype),
               torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype))
              for _ in range(num_layers)]
    order = torch.randperm(num_blocks).tolist()   # scattered blocks, as a busy cache holds them
    firsts = [sum(counts[:i]) for i in range(rows)]
    specs = [RowSpec(i, 1, contexts[i], order[firsts[i]:firsts[i] + counts[i]]) for i in range(rows)]
    q = torch.randn(rows, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    scale = head_dim ** -0.5
    result: dict = {}
    outputs = {}
    for backend in ("sdpa", "flex"):
        flex_blocks = num_blocks if backend == "flex" else 0
        build_ms, step_ms = [], []
        for i in range(repeats + 2):
            started = time.perf_counter()
            meta = build_metadata(specs, block_size, None, device, flex_cache_blocks=flex_blocks)
            _sync(device)
            built = time.perf_counter()
            for k_cache, v_cache in caches:
                out = attend(q, k_cache, v_cache, meta, scale, None)
            _sync(device)
            if i >= 2:   # the first two: compiling, caches warming
                build_ms.append(1000 * (built - started))
                step_ms.append(1000 * (time.perf_counter() - built))
        outputs[backend] = out.float()
        result[backend] = {"attention_ms": statistics.median(step_ms), "metadata_ms": statistics.median(build_ms)}
    result["max_abs_diff"] = (outputs["sdpa"] - outputs["flex"]).abs().max().item()
    del caches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench flex-attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--contexts", default="256,4096", help="comma list of context lengths (tokens per row)")
    p.add_argument("--shape", default="9,3,64,30", help="heads,kv_heads,head_dim,layers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    lengths = [int(c) for c in args.contexts.split(",")]
    cases = {str(n): [n] * args.rows for n in lengths}
    cases["mixed"] = [max(lengths)] + [min(lengths)] * (args.rows - 1)
    figures = {}
    for name, contexts in cases.items():
        fig = figures[name] = measure(contexts, shape, args.block_size, dtype, device, args.repeats)
        print(f"{args.rows} rows, context {name:>5s}: sdpa {fig['sdpa']['attention_ms']:8.3f} ms "
              f"(+{fig['sdpa']['metadata_ms']:.2f} ms metadata), flex {fig['flex']['attention_ms']:8.3f} ms "
              f"(+{fig['flex']['metadata_ms']:.2f} ms metadata), max |diff| {fig['max_abs_diff']:.2e}", flush=True)
    report.save_run("flex-attention", args.out_dir, {
        "rows": args.rows, "shape": {"heads": shape[0], "kv_heads": shape[1], "head_dim": shape[2], "layers": shape[3]},
        "block_size": args.block_size, "dtype": args.dtype, "device": args.device, "by_case": figures})
