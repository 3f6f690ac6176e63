"""Weight bytes streamed per second by the quantized matmul against the packed float32 one.

    python -m bench quant-gemm --threads 1,2 --rows 1,4,16,64
    python -m bench quant-gemm --formats q4_k,q6_k --shapes 896x4864 --builds native,avx2 --repeat 5

GB/s counts each format's own weight bytes once per call (what a decode step must read); the
GFLOP/s column is 2*M*N*K / time. Calls rotate over copies of each weight that together exceed the
last-level cache, so the bytes come from memory as in a real step. `--builds` times the kernels
built for several feature sets of this CPU (native, avx2, portable, vnni256: 256-bit VNNI only) in one process, and `--repeat`
interleaves them over rounds and reports each one's median, so a noisy machine is seen by all of
them alike. Run it on a quiet machine and compare rows within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench import report
from conveyor import kernels
from conveyor.kernels import gemm as fgemm
from conveyor.kernels import quant
from conveyor.kernels.build import NARROWER_BUILDS

SHAPES = "576x1536,1536x576,49152x576"      # (N, K): down-like, up-like, tied lm_head
ROTATE_BYTES = 256 << 20                    # more than any last-level cache here
BUILDS = ("native", *NARROWER_BUILDS)
# K-quant file blocks: bytes per 256 weights and where the f16 scales sit (gguf cannot quantize these).
K_BLOCKS = {"q4_k": (144, (0, 2)), "q5_k": (176, (0, 2)), "q6_k": (210, (208,))}


def _time(fn, min_s: float) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_s or calls < 3:
        fn()
        calls += 1
    return elapsed / calls


def _blocks(fmt: str, w: torch.Tensor) -> np.ndarray:
    """GGUF blocks of `fmt` for w (N, K): quantized by gguf, or random codes with sane scales (K-quants)."""
    import gguf
    n, k = w.shape
    if fmt not in K_BLOCKS:
        return gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, fmt.upper()))
    size, scales = K_BLOCKS[fmt]
    raw = np.random.default_rng(0).integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    for at in scales:
        raw[:, :, at:at + 2] = np.array([1e-3], np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench quant-gemm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--formats", default="f32,q8_0,q4_0,q4_1",
                        help="f32 and any of " + ",".join(quant.FORMATS) + " (int8 = q8_0 from float weights)")
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated NxK")
    parser.add_argument("--builds", default="native", help="comma-separated: " + ",".join(BUILDS))
    parser.add_argument("--repeat", type=int, default=1, help="rounds over the builds; the median is reported")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument("--stream", action="store_true",
                        help="also measure the C stream read of 2 GiB on each thread count (the wall), in the same run")
    parser.add_argument("--resident", action="store_true",
                        help="one copy of each weight, no rotation: with a shape that fits the caches this is the "
                             "kernel's compute ceiling, the rate it could stream at if memory kept up")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = parser.parse_args(argv)
    rows: list[dict] = []
    native = kernels.cpu_features()
    libs = {}
    for name in args.builds.split(","):
        features = native if name == "native" else NARROWER_BUILDS[name] & native
        libs[name] = kernels.library_for(features)
        assert libs[name] is not None, "no C compiler"
        print(f"build {name}: cpu {kernels.describe(features)}, quant path {quant.isa(libs[name])}")
    print(f"{'N x K':>12} {'fmt':>5} {'build':>8} {'thr':>3} {'M':>3} {'ms':>8} {'GB/s':>7} {'GFLOP/s':>8}")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        w = torch.randn(n, k)
        for fmt in args.formats.split(","):
            if fmt not in ("f32", "int8") and not quant.can_keep(fmt, k):
                print(f"{n:>6}x{k:<5} {fmt:>5}: K = {k} does not fit the format, skipped")
                continue
            blocks = None if fmt in ("f32", "int8") else _blocks(fmt, w)
            one_copy = n * k * 4 if fmt == "f32" else n * k if fmt == "int8" else blocks.nbytes
            # the copies together exceed the last-level cache, unless the compute ceiling is asked for
            copies = 1 if args.resident else max(2, -(-ROTATE_BYTES // one_copy))
            weights = {}
            for name, lib in libs.items():
                if fmt == "f32":
                    weights[name] = [fgemm.pack(w) for _ in range(copies)]
                elif fmt == "int8":
                    weights[name] = [quant.quantize_int8(w) for _ in range(copies)]
                else:
                    weights[name] = [quant.repack(lib, fmt, blocks, n, k) for _ in range(copies)]
            nbytes = n * k * 4 if fmt == "f32" else weights[next(iter(libs))][0].nbytes
            for threads in map(int, args.threads.split(",")):
                torch.set_num_threads(threads)
                if args.stream:
                    from bench.kernels.limits import stream_read_bandwidth
                    wall = stream_read_bandwidth(threads)
                    rows.append({"stream_read_gb_s": wall / 1e9, "threads": threads})
                    print(f"{'stream read':>24} {threads:>3}  {'':>12} {wall / 1e9:>7.1f}")
                for m in map(int, args.rows.split(",")):
                    x = torch.randn(m, k)
                    times: dict[str, list[float]] = {name: [] for name in libs}
                    for _ in range(args.repeat):
                        for name, lib in libs.items():
                            turn = iter(range(1 << 62))

                            def call(lib=lib, ws: list = weights[name]) -> None:
                                weight = ws[next(turn) % len(ws)]
                                if fmt == "f32":
                                    fgemm.gemm(lib, x, weight, n)
                                else:
                                    quant.gemm(lib, x, weight, num_threads=threads)
                            times[name].append(_time(call, args.min_time))
                    for name in libs:
                        t = statistics.median(times[name])
                        rows.append({"n": n, "k": k, "format": fmt, "build": name, "threads": threads, "m": m,
                                     "ms": t * 1e3, "gb_s": nbytes / t / 1e9, "gflop_s": 2 * m * n * k / t / 1e9})
                        print(f"{n:>6}x{k:<5} {fmt:>5} {name:>8} {threads:>3} {m:>3} {t * 1e3:>8.3f} "
                              f"{nbytes / t / 1e9:>7.1f} {2 * m * n * k / t / 1e9:>8.1f}", flush=True)
    options = {key: value for key, value in vars(args).items() if key != "out_dir"}
    report.save_run("quant-gemm", args.out_dir, {"options": options, "results": rows})
