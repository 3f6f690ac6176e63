"""The tree's quantized matmul against a baseline revision's, alternated in one process.

    python -m bench kernel-ab --baseline c059516 [--sets 7b,0.5b-layers,0.5b-output] [--rounds 20]

On a shared host the memory bandwidth swings by a third within minutes, more than most kernel changes
are worth, so two builds timed minutes apart say little. Here kernel_ab.c links both: the baseline's
matmul sources (those of SOURCES it has, taken from git, their entry points renamed) beside the tree's, and
each round runs one decode step's matmuls over a set's layers with each in turn (the order flipping),
then reads the same buffers with the stream kernel (the wall for those bytes). Reported: each build's
GB/s, the stream's, and the median per-round speedup (tree over baseline) with its quartiles. The two
must share the repacked panel layout (kquant_repack.c is the tree's). JSON to --out-dir.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import tempfile
from pathlib import Path

from bench import report
from conveyor.kernels.formats import FORMATS

build = importlib.import_module("conveyor.kernels.build")   # the module (the package's `build` is its function)
KERNELS = Path(build.__file__).parent
# the matmul's sources and headers; a revision older than one of them lacks it
SOURCES = ("kquant.c", "kquant_k.c", "kquant_sets.c", "quant.c")
HEADERS = ("kernels.h", "kq_vec.h", "kq_codes.h", "half.h", "pool.h")
RENAMED = ("kq_linear", "kq_panel_k", "kq_panel_sets", "kq_quantize_row_k", "quant_activations", "kq_activations_k",
           "quant_panel_rows")
# name -> (shapes as (format, N, K), layers): each set's weights are several times a last-level cache
SETS: dict[str, tuple[list[tuple[str, int, int]], int]] = {
    "7b": ([("q4_k", 4608, 3584), ("q4_k", 3584, 3584), ("q4_k", 37888, 3584), ("q4_k", 3584, 18944)], 8),
    "7b-q6_k": ([("q6_k", 3584, 18944), ("q6_k", 4608, 3584)], 8),
    "7b-output": ([("q6_k", 152064, 3584)], 1),
    "0.5b-layers": ([("q5_0", 1152, 896), ("q5_0", 896, 896), ("q5_0", 9728, 896), ("q6_k", 896, 4864)], 24),
    "0.5b-output": ([("q8_0", 151936, 896)], 1),
    "bundled-layers": ([("q4_1", 960, 576), ("q4_1", 576, 576), ("q4_1", 3072, 576), ("q4_1", 576, 1536)], 30),
    "bundled-output": ([("q8_0", 49152, 576)], 1),
}


def compile_ab(baseline: str, work: Path) -> Path:
    """kernel_ab linked against the tree's kernels and the baseline's, renamed."""
    base = work / "base"
    base.mkdir()
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=KERNELS, capture_output=True, text=True,
                          check=True).stdout.strip()
    sources = []
    for name in SOURCES + HEADERS:
        shown = subprocess.run(["git", "show", f"{baseline}:conveyor/kernels/{name}"], cwd=root, capture_output=True)
        if shown.returncode == 0:
            (base / name).write_bytes(shown.stdout)
            sources += [name] if name.endswith(".c") else []
    flags = [f for f in build.compile_flags(build.cpu_features()) if f not in ("-shared", "-fPIC")]
    objects = []
    for name in sources:
        obj = work / f"base_{name}.o"
        subprocess.run(["gcc", *flags, *[f"-D{s}=base_{s}" for s in RENAMED], f"-I{base}", "-c", str(base / name),
                        "-o", str(obj)], check=True)
        objects.append(str(obj))
    exe = work / "kernel_ab"
    tree = [str(KERNELS / n) for n in (*SOURCES, "kquant_repack.c", "pool.c", "stream.c")]
    subprocess.run(["gcc", *flags, f"-I{KERNELS}", str(Path(__file__).with_suffix(".c")), *tree, *objects, "-lm",
                    "-o", str(exe)], check=True)
    return exe


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench kernel-ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="a git revision whose kernels to compare against")
    p.add_argument("--sets", default="7b,0.5b-layers,0.5b-output", help="comma-separated: " + ",".join(SETS))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--rows", type=int, default=1, help="M: rows of each matmul (1: a one-stream decode step)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_ab(args.baseline, Path(tmp))
        for name in args.sets.split(","):
            shapes, layers = SETS[name]
            spec = ",".join(f"{FORMATS[f].code}:{n}:{k}" for f, n, k in shapes)
            out = subprocess.run([str(exe), spec, str(layers), str(args.rounds), str(args.rows), str(args.threads)],
                                 capture_output=True, text=True, check=True).stdout
            results[name] = {"shapes": shapes, "layers": layers, **json.loads(out)}
            r = results[name]
            print(f"{name}: tree {r['tree_gb_s']:.1f} GB/s, baseline {r['baseline_gb_s']:.1f}, stream of the same "
                  f"bytes {r['stream_gb_s']:.1f}; speedup {r['speedup_median']:.3f} (quartiles {r['speedup_q1']:.3f}, "
                  f"{r['speedup_q3']:.3f})", flush=True)
    report.save_run("kernel-ab", args.out_dir, {"baseline": args.baseline, "rounds": args.rounds, "rows": args.rows,
                                                 "threads": args.threads, "sets": results})
