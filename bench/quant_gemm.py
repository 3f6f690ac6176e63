"""Weight bytes streamed per second by the quantized matmul against the packed float32 one.

    python -m bench.quant_gemm --threads 1,2 --rows 1,4,16,64

GB/s counts each format's own weight bytes once per call (what a decode step must read); the
GFLOP/s column is 2*M*N*K / time. Calls rotate over copies of each weight that together exceed the
last-level cache, so the bytes come from memory as in a real step. Run it on a quiet machine and
compare rows within one run.
"""

from __future__ import annotations

import argparse
import time

import torch

from conveyor import kernels
from conveyor.kernels import gemm as fgemm
from conveyor.kernels import quant

SHAPES = [(576, 1536), (1536, 576), (49152, 576)]   # (N, K): down-like, up-like, tied lm_head
ROTATE_BYTES = 256 << 20                            # more than any last-level cache here


def _time(fn, min_s: float = 0.3) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_s or calls < 3:
        fn()
        calls += 1
    return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,4,16")
    args = parser.parse_args()
    lib = kernels.library()
    assert lib is not None, "no C compiler"
    print(f"cpu {kernels.describe(lib.features)}, quant path {quant.isa(lib)}")
    print(f"{'N x K':>12} {'fmt':>5} {'thr':>3} {'M':>3} {'ms':>8} {'GB/s':>7} {'GFLOP/s':>8}")
    for n, k in SHAPES:
        w = torch.randn(n, k)
        import gguf
        copies = max(1, ROTATE_BYTES // (n * k * 4))
        formats = {"f32": [fgemm.pack(w) for _ in range(copies)],
                   "q8_0": [quant.quantize_int8(w) for _ in range(copies)]}
        for name in ("q4_0", "q4_1"):
            blocks = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, name.upper()))
            formats[name] = [quant.repack(lib, name, blocks, n, k) for _ in range(copies)]
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k)
                for name, weights in formats.items():
                    turn = iter(range(1 << 62))

                    def call(weights: list = weights, name: str = name) -> None:
                        weight = weights[next(turn) % len(weights)]
                        if name == "f32":
                            fgemm.gemm(lib, x, weight, n)
                        else:
                            quant.gemm(lib, x, weight, num_threads=threads)
                    nbytes = n * k * 4 if name == "f32" else weights[0].nbytes
                    t = _time(call)
                    print(f"{n:>6}x{k:<5} {name:>5} {threads:>3} {m:>3} {t * 1e3:>8.3f} {nbytes / t / 1e9:>7.1f} "
                          f"{2 * m * n * k / t / 1e9:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
