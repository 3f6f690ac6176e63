"""What this machine can physically do with this model: matmul rate, memory bandwidth, and the floors.

A decode step reads every weight once and does 2 x (matmul parameters) FLOPs per row, so its time
is at least max(weight bytes / bandwidth, FLOPs / peak matmul rate). The matmul rate is measured on
the model's own weight shapes (every layer, so the weights do not fit in cache, as in a real step)
at several row counts M; the peak over M is the machine's FLOP rate. torch's own rate at small M is
far below it (a skinny matmul is limited by how fast it streams the weights, and torch's float32
GEMV streams them slower than the bandwidth test), so the time torch's matmuls take at the step's M
is reported beside the floor as a second, practical reference. Attention over the KV cache and
everything outside the matmuls are left out: a floor is a lower bound, not a reachable target.
"""

from __future__ import annotations

import time

DTYPE_BYTES = 4   # float32: the precision every system is compared in


def model_arch(model: str | None):  # -> conveyor.model.llama.ModelArch
    """The model's shapes without loading its weights."""
    from conveyor.model.checkpoint import resolve_model_path
    from conveyor.model.loader import read_arch

    return read_arch(resolve_model_path(model))


def weight_shapes(arch) -> tuple[list[tuple[int, int]], tuple[int, int]]:  # noqa: ANN001
    """(per-layer (out, in) matmul shapes, lm_head shape), as conveyor fuses them (qkv, gate+up)."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    layer = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    return layer, (arch.vocab_size, h)


def param_counts(arch) -> dict[str, int]:  # noqa: ANN001
    layer, head = weight_shapes(arch)
    layers = arch.num_layers * sum(o * i for o, i in layer)
    return {"layer_matmul_params": layers, "lm_head_params": head[0] * head[1],
            "matmul_params": layers + head[0] * head[1], "num_parameters": arch.num_parameters}


def measure_matmul(arch, sizes: list[int], threads: int, repeats: int = 5) -> dict[int, float]:  # noqa: ANN001
    """FLOP/s of one pass over every matmul of the model (all layers + lm_head) at M rows.

    Repeats go round-robin over the sizes and the best pass counts, so a burst of load from another
    process spoils one repeat rather than every repeat of one size.
    """
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    layer, head = weight_shapes(arch)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=generator) * 0.02 for _ in range(arch.num_layers) for o, i in layer]
    weights.append(torch.randn(*head, generator=generator) * 0.02)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    inputs = {m: {w.shape[1]: torch.randn(m, w.shape[1], generator=generator) for w in weights} for m in sizes}
    best = dict.fromkeys(sizes, float("inf"))
    with torch.inference_mode():
        for repeat in range(repeats + 1):   # the first round warms the allocator and caches
            for m in sizes:
                start = time.perf_counter()
                for w in weights:
                    F.linear(inputs[m][w.shape[1]], w)
                if repeat:
                    best[m] = min(best[m], time.perf_counter() - start)
    return {m: flops_per_row * m / best[m] for m in sizes}


def measure_bandwidth(threads: int, size_bytes: int = 512 * 2**20, repeats: int = 5) -> dict[str, float]:
    """Bytes/s reading (sum) and copying (read + write) a buffer far larger than the caches."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(size_bytes // 4)
    y = torch.empty_like(x)
    read = copy = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        x.sum()
        read = min(read, time.perf_counter() - start)
        start = time.perf_counter()
        y.copy_(x)
        copy = min(copy, time.perf_counter() - start)
    return {"read_bytes_per_s": size_bytes / read, "copy_bytes_per_s": 2 * size_bytes / copy}


class StreamProbe:
    """Bytes/s the C kernels' thread pool reads from a buffer of `size_bytes` (default 2 GiB), split as
    the matmuls split their weights: the wall a one-row decode step streams against. The buffer is
    allocated once, so a benchmark can measure the wall again beside each of its rounds."""

    def __init__(self, threads: int, size_bytes: int = 2 * 2**30) -> None:
        import ctypes

        import torch

        from conveyor import kernels

        built = kernels.library()
        if built is None:
            raise RuntimeError("the stream test needs the C kernels (no C compiler found)")
        self.lib = built.lib
        self.lib.kq_stream_read.restype = ctypes.c_int64
        self.lib.kq_stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        self.threads = threads
        self.buf = torch.ones(size_bytes + 64, dtype=torch.uint8)
        self.start = (-self.buf.data_ptr()) % 64
        self.nbytes = (size_bytes - self.start) // 256 * 256

    def __call__(self, repeats: int = 5) -> float:
        """The best of `repeats` reads (after one to warm up)."""
        best = float("inf")
        for _ in range(repeats + 1):
            began = time.perf_counter()
            self.lib.kq_stream_read(self.buf.data_ptr() + self.start, self.nbytes, 1 << 20, self.threads)
            best = min(best, time.perf_counter() - began)
        return self.nbytes / best


def stream_read_bandwidth(threads: int, size_bytes: int = 2 * 2**30, repeats: int = 5) -> float:
    """StreamProbe's figure, measured once."""
    return StreamProbe(threads, size_bytes)(repeats)


def step_floor(batch: int, params: dict[str, int], bandwidth: float, rates: dict[int, float]) -> dict[str, float | str]:
    """Floor on one decode step of `batch` rows: weights read once, 2 x matmul params FLOPs per row."""
    flops = 2 * params["matmul_params"] * batch
    memory_s = params["matmul_params"] * DTYPE_BYTES / bandwidth
    compute_s = flops / max(rates.values())
    return {"memory_s": memory_s, "compute_s": compute_s, "floor_s": max(memory_s, compute_s),
            "bound": "bandwidth" if memory_s >= compute_s else "matmul rate",
            "torch_matmul_s": flops / rate_at(rates, batch)}


def rate_at(rates: dict[int, float], m: int) -> float:
    """The best rate torch showed for M = m rows: M rows can always be run as ceil(M / M') passes
    of a measured M', or padded up to a larger measured M', so the fastest of those counts."""
    seconds_per_pass = {k: k / r for k, r in rates.items()}   # per FLOP of one row
    return m / min(-(-m // k) * t for k, t in seconds_per_pass.items())


def workload_floor(prompt_lens: list[int], output_tokens: int, max_batch: int, params: dict[str, int],
                   bandwidth: float, rates: dict[int, float]) -> dict[str, float]:
    """Floor for the offline workload: prefill FLOPs at the peak rate (lm_head only on each prompt's
    last token), then (output_tokens - 1) decode steps per wave of `max_batch` requests."""
    prefill_flops = (2 * params["layer_matmul_params"] * sum(prompt_lens)
                     + 2 * params["lm_head_params"] * len(prompt_lens))
    prefill_s = prefill_flops / max(rates.values())
    batch = max(1, min(max_batch, len(prompt_lens)))
    decode_tokens = len(prompt_lens) * max(output_tokens - 1, 0)
    decode_s = decode_tokens / batch * step_floor(batch, params, bandwidth, rates)["floor_s"]
    total_s = prefill_s + decode_s
    return {"prefill_flops": prefill_flops, "decode_flops": 2 * params["matmul_params"] * decode_tokens,
            "prefill_s": prefill_s, "decode_s": decode_s, "decode_batch": batch, "total_s": total_s,
            "output_tokens_per_s": len(prompt_lens) * output_tokens / total_s if total_s else float("inf")}


def measure(model: str | None, threads: int, batch_sizes: list[int]) -> dict:
    """Every figure of the physical limit for `model` at the given decode batch sizes."""
    arch = model_arch(model)
    params = param_counts(arch)
    sizes = sorted({1, 64, 256, 512, *batch_sizes})
    rates = measure_matmul(arch, sizes, threads)
    bw = measure_bandwidth(threads)
    bw["stream_read_bytes_per_s"] = stream_read_bandwidth(threads)
    bandwidth = max(bw.values())
    return {
        "threads": threads,
        "params": params,
        "weight_bytes": params["matmul_params"] * DTYPE_BYTES,
        "flops_per_token": 2 * params["matmul_params"],
        "matmul_flops_per_s": rates,
        "peak_matmul_flops_per_s": max(rates.values()),
        "bandwidth": {**bw, "used_bytes_per_s": bandwidth},
        "decode_step_floor": {b: step_floor(b, params, bandwidth, rates) for b in sorted(set(batch_sizes))},
    }


def compare_steps(limits: dict, decode_steps: dict[int, dict]) -> dict[int, dict]:
    """conveyor's median decode step time per batch size against the floor there (floor / measured)."""
    params = limits["params"]
    bandwidth = limits["bandwidth"]["used_bytes_per_s"]
    rates = {int(k): v for k, v in limits["matmul_flops_per_s"].items()}
    out = {}
    for rows, stats in decode_steps.items():
        floor = step_floor(rows, params, bandwidth, rates)
        out[rows] = {"num_steps": stats["num_steps"], "measured_s": stats["median_s"], "floor_s": floor["floor_s"],
                     "bound": floor["bound"], "pct_of_floor": 100 * floor["floor_s"] / stats["median_s"],
                     "torch_matmul_s": floor["torch_matmul_s"],
                     "pct_of_torch_matmul": 100 * floor["torch_matmul_s"] / stats["median_s"]}
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    from pathlib import Path

    from bench import report

    p = argparse.ArgumentParser(prog="python -m bench limits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,16,32,64")
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)
    lim = measure(args.model, args.threads, [int(n) for n in args.batch_sizes.split(",")])
    report.print_summary({"limits": lim, "results": {}, "base": None, "single_request_decode": {"conveyor": None},
                          "goals": []}, None)
    report.save_run("limits", args.out_dir, {"limits": lim})
