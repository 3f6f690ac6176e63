"""The printed table, the issue's goals, the machine/version record and the plots of one run."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- machine and versions


def machine() -> dict:
    info: dict = {"platform": platform.platform(), "python": platform.python_version(),
                  "logical_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0))}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        models = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
        info["cpu_model"] = models[0] if models else platform.processor()
        fields = dict(line.split(":", 1) for line in cpuinfo.splitlines()[:30] if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        info["cpu_cores_per_socket"] = int(fields.get("cpu cores", 0)) or None
        info["cpu_mhz"] = float(fields.get("cpu MHz", 0)) or None
        flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
        info["cpu_flags"] = sorted(f for f in flags.split() if f.startswith(("avx", "fma", "amx")))
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        info["mem_total_gb"] = int(meminfo[0].split()[1]) / 1e6
        info["load_average_at_start"] = os.getloadavg()
    except OSError:
        info["cpu_model"] = platform.processor()
    info["lscpu"] = lscpu()
    if gpus := nvidia_gpus():
        info["gpus"] = gpus
    return info


def nvidia_gpus() -> list[str]:
    """nvidia-smi's name, memory and driver of each GPU; empty where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def lscpu() -> dict[str, str]:
    """lscpu's naming of the CPU (vendor, model name, family/model/stepping: which core generation)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    wanted = ("Vendor ID", "Model name", "CPU family", "Model", "Stepping", "L2 cache", "L3 cache")
    fields = (line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in fields if k.strip() in wanted}


def versions(llama_commit: str | None) -> dict:
    out: dict = {}
    for dist in ("conveyor", "torch", "transformers", "numpy", "httpx"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        out["conveyor_git"] = head + ("-dirty" if dirty else "") if head else None
    except (OSError, subprocess.TimeoutExpired):
        out["conveyor_git"] = None
    out["llama.cpp"] = llama_commit
    return out


# ----------------------------------------------------------------------------- the table


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def table(results: dict[str, dict], base_key: str | None) -> str:
    """One row per run; the last column is conveyor's output tokens/s divided by the row's."""
    base = results.get(base_key) if base_key else None
    header = (f"{'system':34s} {'out tok/s':>10s} {'req/s':>7s} {'tot tok/s':>10s} {'TTFT p50':>9s} "
              f"{'TTFT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s} {'TPOT':>7s} {'conveyor÷':>9s}")
    lines = [header, "-" * len(header)]
    for key, fig in results.items():
        if fig.get("skipped"):
            lines.append(f"{key:34s} skipped: {fig['skipped']}")
            continue
        ttft, itl, tpot = fig.get("ttft_ms", {}), fig.get("itl_ms", {}), fig.get("tpot_ms", {})
        ratio = fig.get("ratio_conveyor_to_this")
        lines.append(
            f"{key:34s} {_fmt(fig.get('output_tokens_per_s')):>10s} {_fmt(fig.get('requests_per_s'), 2):>7s} "
            f"{_fmt(fig.get('total_tokens_per_s')):>10s} {_fmt(ttft.get('p50'), 0):>9s} {_fmt(ttft.get('p99'), 0):>9s} "
            f"{_fmt(itl.get('p50'), 0):>8s} {_fmt(itl.get('p99'), 0):>8s} {_fmt(tpot.get('mean'), 0):>7s} "
            f"{_fmt(ratio, 2) + 'x' if ratio else '-':>9s}")
    lines.append("latencies in ms; TPOT is the mean; conveyor÷ = conveyor's output tokens/s / the row's "
                 f"(base: {base_key})")
    return "\n".join(lines)


def add_ratios(results: dict[str, dict], base_key: str | None) -> None:
    base = results.get(base_key) if base_key else None
    for fig in results.values():
        if base and fig.get("output_tokens_per_s"):
            fig["ratio_conveyor_to_this"] = base["output_tokens_per_s"] / fig["output_tokens_per_s"]


def best(results: dict[str, dict], prefix: str) -> tuple[str, dict] | None:
    runs = [(k, v) for k, v in results.items() if k.startswith(prefix) and v.get("output_tokens_per_s")]
    return max(runs, key=lambda kv: kv[1]["output_tokens_per_s"]) if runs else None


def goals(results: dict[str, dict], base_key: str, floor: dict | None, single: dict | None,
          peer_family: str) -> list[dict]:
    """Where conveyor stands on each target of the issue; a target whose peer did not run is 'not measured'.

    peer_family: the llama-server family on the same weights (llama-server-f32; -q8_0 for int8, -q4_1 for gguf)."""
    peer_name = peer_family.removeprefix("llama-server-").upper()
    base = results.get(base_key, {})
    ours = base.get("output_tokens_per_s")
    out = []

    def ratio_goal(name: str, prefix: str, target: float) -> None:
        peer = best(results, prefix)
        if ours and peer:
            value = ours / peer[1]["output_tokens_per_s"]
            out.append({"goal": name, "target": f">= {target}x", "value": f"{value:.2f}x ({peer[0]})",
                        "met": value >= target})
        else:
            out.append({"goal": name, "target": f">= {target}x", "value": "not measured", "met": None})

    ratio_goal(f"offline output tok/s vs best llama-server {peer_name} -np", f"{peer_family}/", 1.5)
    if ours and floor:
        pct = 100 * floor["total_s"] / base["elapsed_s"]
        out.append({"goal": "share of the compute floor (workload a)", "target": ">= 75%",
                    "value": f"{pct:.0f}% (floor {floor['total_s']:.1f} s, measured {base['elapsed_s']:.1f} s)",
                    "met": pct >= 75})
    llama_p1 = results.get(f"{peer_family}/p1")
    if single and llama_p1 and llama_p1.get("tpot_ms", {}).get("mean"):
        theirs = 1000 / llama_p1["tpot_ms"]["mean"]
        out.append({"goal": f"single-request decode vs llama-server --parallel 1 {peer_name}", "target": ">= 1.25x",
                    "value": f"{single['decode_tokens_per_s']:.1f} vs {theirs:.1f} tok/s "
                             f"({single['decode_tokens_per_s'] / theirs:.2f}x)",
                    "met": single["decode_tokens_per_s"] >= 1.25 * theirs})
    else:
        out.append({"goal": f"single-request decode vs llama-server --parallel 1 {peer_name}", "target": ">= 1.25x",
                    "value": "not measured", "met": None})
    servers = [(k, v) for k, v in results.items() if k.startswith("conveyor-server/c") and v.get("output_tokens_per_s")]
    if ours and servers:
        key, fig = max(servers, key=lambda kv: kv[1]["output_tokens_per_s"])
        value = fig["output_tokens_per_s"] / ours
        out.append({"goal": "conveyor serve vs offline LLM.generate, same requests", "target": ">= 0.95x",
                    "value": f"{value:.2f}x ({key})", "met": value >= 0.95})
    peer = best(results, f"{peer_family}/")
    for c in (32, 64):
        fig = results.get(f"conveyor-server/c{c}", {})
        if peer and fig.get("output_tokens_per_s"):
            value = fig["output_tokens_per_s"] / peer[1]["output_tokens_per_s"]
            out.append({"goal": f"conveyor serve c{c} vs best llama-server {peer_name} -np", "target": ">= 1.3x",
                        "value": f"{value:.2f}x ({peer[0]})", "met": value >= 1.3})
    return out


def goals_text(rows: list[dict]) -> str:
    marks = {True: "met", False: "NOT met", None: "-"}
    return "\n".join(f"  {r['goal']:58s} {r['target']:>10s}  {r['value']:40s} {marks[r['met']]}" for r in rows)


def print_summary(document: dict, out_json: Path | None) -> None:
    if document["results"]:
        print()
        print(table(document["results"], document["base"]))
    lim = document.get("limits")
    if lim:
        rates = ", ".join(f"M={m}: {r / 1e9:.0f}" for m, r in lim["matmul_flops_per_s"].items())
        rates += f" (peak {lim['peak_matmul_flops_per_s'] / 1e9:.0f})"
        bw = lim["bandwidth"]
        print(f"\nphysical limit ({lim['threads']} threads): float32 matmul GFLOP/s {rates}; bandwidth read "
              f"{bw['read_bytes_per_s'] / 1e9:.1f} GB/s, copy {bw['copy_bytes_per_s'] / 1e9:.1f} GB/s; "
              f"{lim['weight_bytes'] / 1e6:.0f} MB of weights, {lim['flops_per_token'] / 1e9:.3f} GFLOP/token")
        for b, f in lim["decode_step_floor"].items():
            print(f"  decode step floor at batch {b:3d}: {f['floor_s'] * 1000:7.2f} ms ({f['bound']} bound); "
                  f"torch's matmuls alone take {f['torch_matmul_s'] * 1000:.2f} ms")
        for rows, c in sorted(lim.get("conveyor_decode_steps", {}).items(), key=lambda kv: -kv[1]["num_steps"])[:6]:
            print(f"  conveyor decode step at batch {rows:3d}: {c['measured_s'] * 1000:7.2f} ms (median of "
                  f"{c['num_steps']} steps) = {c['pct_of_floor']:.0f}% of the floor, "
                  f"{c['pct_of_torch_matmul']:.0f}% of torch's matmul time"
                  + ("  (over 100%: other load slowed the limit measurement)" if c["pct_of_floor"] > 100 else ""))
        if lim.get("note"):
            print(f"  ({lim['note']})")
        wf = lim.get("workload_floor")
        if wf:
            print(f"  workload floor: {wf['total_s']:.1f} s (prefill {wf['prefill_s']:.1f} s + decode "
                  f"{wf['decode_s']:.1f} s at batch {wf['decode_batch']}) = "
                  f"{wf['output_tokens_per_s']:.0f} output tok/s")
    single = document["single_request_decode"]
    if single["conveyor"]:
        peers = [(key.removesuffix("/p1_tok_s"), rate) for key, rate in single.items()
                 if key.endswith("/p1_tok_s") and rate]
        print(f"\nsingle-request decode: conveyor {single['conveyor']['decode_tokens_per_s']:.1f} tok/s"
              + "".join(f", {name} --parallel 1 {rate:.1f} tok/s" for name, rate in peers))
    if document["goals"]:
        print("\ngoals:")
        print(goals_text(document["goals"]))
    if out_json is not None:
        print(f"\nJSON: {out_json}")
    plots = document.get("plots")
    if plots:
        print("plots: " + (", ".join(plots) if isinstance(plots, list) else plots))


# ----------------------------------------------------------------------------- plots


def plots(results: dict[str, dict], samples: dict[str, dict], out_dir: Path) -> list[str] | str:
    """PNG files: throughput against concurrency per system; TTFT and ITL distributions (CDFs). A plot
    with nothing to draw (no system measured it) is not written."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: pip install -e '.[bench]'"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    families: dict[str, list[tuple[int, float]]] = {}
    for key, res in results.items():
        if res.get("skipped") or not res.get("output_tokens_per_s") or res.get("concurrency") is None:
            continue
        families.setdefault(key.split("/")[0], []).append((res["concurrency"], res["output_tokens_per_s"]))
    if families:
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, points in sorted(families.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sequences (server slots, batch size, max_num_seqs)")
        ax.set_ylabel("output tokens/s")
        ax.set_title("Throughput on the offline workload")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        path = out_dir / "throughput_vs_concurrency.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(str(path))
    for metric, title in (("ttft_ms", "Time to first token"), ("itl_ms", "Inter-token latency")):
        measured = {key: sorted(sample[metric]) for key, sample in samples.items() if sample.get(metric)}
        if not measured:
            continue
        fig, ax = plt.subplots(figsize=(8, 5))
        for key, values in measured.items():
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], drawstyle="steps-post", label=key)
        ax.set_xscale("log")
        ax.set_xlabel(f"{metric.removesuffix('_ms').upper()} (ms)")
        ax.set_ylabel("fraction of samples ≤ x")
        ax.set_title(f"{title}: cumulative distribution")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        path = out_dir / f"{metric.removesuffix('_ms')}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(str(path))
    return files


def save_run(name: str, out_dir: Path, fields: dict, llama_commit: str | None = None, *, stamp: str | None = None,
             machine_info: dict | None = None) -> Path:
    """Write a bench's run to <out_dir>/<name>-<stamp>.json (stamp: now) with the command that ran it, the machine
    (`machine_info` when it was taken at the start) and the versions in front of `fields`; print and return the
    path. Every benchmark's JSON is written here, so every run reads the same way."""
    main = sys.modules["__main__"]
    module = main.__spec__.name if getattr(main, "__spec__", None) else Path(sys.argv[0]).stem
    out = out_dir / f"{name}-{stamp or time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(out, {"command": " ".join(["python -m", module.removesuffix(".__main__"), *sys.argv[1:]]),
                     "machine": machine_info or machine(), "versions": versions(llama_commit), **fields})
    print(f"JSON: {out}")
    return out


def write_json(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)

    def clean(value):  # noqa: ANN001, ANN202 - JSON has no NaN or int keys
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    path.write_text(json.dumps(clean(document), indent=1))
