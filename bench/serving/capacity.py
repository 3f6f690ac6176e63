"""Capacity under a latency SLO: the highest Poisson request rate a server sustains while at least 90 %
of requests meet both a TTFT and a TPOT target (DistServe's goodput, measured at the client).

    python -m bench capacity                                  # the bundled model, conveyor vs llama-server
    python -m bench capacity --model FILE.gguf --ttft-ms 4000 --tpot-ms 200 --rates 0.1,0.14,0.2,0.28

Every system gets the same requests (seeded token-id prompts, `ignore_eos`, a fixed output length) on
the same seeded arrivals at each rung of a ladder of rates, climbing until two rungs in a row miss the
target attainment (or the ladder ends), then --refine rungs bisect (geometrically) between the highest
rate that met it and the next that did not. Per rung: attainment, p50/p90/p99 of TTFT, TPOT and ITL (from
streamed chunks). conveyor runs `conveyor serve` with its defaults; llama-server serves the same file
with each `-np` of --llama-parallel (its best is the one with the highest capacity). A rung's requests
are max(--min-requests, rate x --rung-s): the arrivals span about --rung-s seconds, then the rung
drains. JSON (command, machine, versions, every rung) and a plot of attainment against rate for every
system go to --out-dir.

With --documents F the workload is mixed: each request is a document (--doc-min-prompt..--doc-max-prompt
tokens, default 2,000-6,000) with probability F, else a chat (--min-prompt..--max-prompt), e.g.
`--documents 0.2 --min-prompt 50 --max-prompt 300`. Each class has its own SLO (documents: --doc-ttft-ms
and the same TPOT); a rung meets the SLO when both classes do, and each class's capacity (the highest
rate at which it met its own) and figures are reported too.
"""

from __future__ import annotations

import argparse
import shlex
import math
from dataclasses import dataclass
from pathlib import Path

from bench import report
from bench.serving import servers
from bench.serving.client import ServingRun, run_serving
from bench.serving.metrics import summarize
from bench.workloads import mixed_workload, offline_workload, warmup_workload

DEFAULT_RATES = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float
    attainment: float   # the share of requests that must meet both

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_s * 1000:.0f} ms and TPOT <= {self.tpot_s * 1000:.0f} ms for >= {self.attainment:.0%}"


def rung_figures(run, slo: Slo) -> dict:  # noqa: ANN001 - a ServingRun
    """summarize()'s figures plus the rung's attainment; a failed request counts as missing the SLO."""
    fig = summarize(run, slo.ttft_s, slo.tpot_s)
    good = fig["goodput"]["good_requests"]
    fig["attainment"] = good / fig["num_requests"] if fig["num_requests"] else 0.0
    fig["meets_slo"] = fig["attainment"] >= slo.attainment
    return fig


def capacity_of(rungs: list[dict], request_class: str | None = None) -> float:
    """The highest rate whose rung met the SLO's attainment, of all requests or of one class (0 when none did)."""
    return max((r["rate_req_s"] for r in rungs
                if (r["classes"][request_class] if request_class else r)["meets_slo"]), default=0.0)


def climb(base_url: str, rates: list[float], args: argparse.Namespace, slo: Slo, vocab_high: int,
          label: str) -> list[dict]:
    """Run the ladder on one running server, stopping after two rungs in a row miss the attainment;
    then --refine rungs at the geometric mean of the highest rate that met it and the next that missed."""
    rungs: list[dict] = []
    misses = 0
    for index, rate in enumerate(rates):
        rungs.append(_rung(base_url, rate, index, args, slo, vocab_high, label))
        misses = 0 if rungs[-1]["meets_slo"] else misses + 1
        if misses == 2:
            break
    for index in range(len(rates), len(rates) + args.refine):
        met = capacity_of(rungs)
        above = [r["rate_req_s"] for r in rungs if not r["meets_slo"] and r["rate_req_s"] > met]
        if met == 0 or not above:
            break
        rungs.append(_rung(base_url, math.sqrt(met * min(above)), index, args, slo, vocab_high, label))
    return sorted(rungs, key=lambda r: r["rate_req_s"])


def _rung(base_url: str, rate: float, index: int, args: argparse.Namespace, slo: Slo, vocab_high: int,
          label: str) -> dict:
    num = max(args.min_requests, math.ceil(rate * args.rung_s))
    # Each rung its own prompts (no prefix cache carries over from the last rung), the same for every system.
    seed = args.seed + 1000 * index
    if not args.documents:
        requests = offline_workload(num, args.min_prompt, args.max_prompt, args.output_tokens,
                                    vocab_high=vocab_high, seed=seed)
        fig = rung_figures(run_serving(base_url, requests, rate=rate, seed=seed), slo)
        _print_rung(label, rate, num, fig)
        return fig
    requests, classes = mixed_workload(num, (args.min_prompt, args.max_prompt),
                                       (args.doc_min_prompt, args.doc_max_prompt), args.documents,
                                       args.output_tokens, vocab_high=vocab_high, seed=seed)
    run = run_serving(base_url, requests, rate=rate, seed=seed)
    slos = {"chat": slo, "document": Slo(args.doc_ttft_ms / 1000, slo.tpot_s, slo.attainment)}
    by_class = {name: rung_figures(ServingRun([r for r, c in zip(run.records, classes) if c == name], run.duration_s,
                                              run.rate, run.max_concurrency), class_slo)
                for name, class_slo in slos.items()}
    fig = rung_figures(run, slo)
    fig["classes"] = by_class
    fig["meets_slo"] = all(f["meets_slo"] for f in by_class.values() if f["num_requests"])
    for name, class_fig in by_class.items():
        _print_rung(f"{label} {name}s", rate, class_fig["num_requests"], class_fig)
    return fig


def _print_rung(label: str, rate: float, num: int, fig: dict) -> None:
    print(f"  {label:24s} {rate:6.2f} req/s x {num:3d}: attainment {fig['attainment']:6.1%}  "
          f"TTFT p50/p90/p99 {_triple(fig['ttft_ms'])} ms  TPOT {_triple(fig['tpot_ms'])} ms  "
          f"ITL p99 {fig['itl_ms']['p99']:.0f} ms  failed {fig['failed']}", flush=True)


def _triple(dist: dict) -> str:
    return "/".join(f"{dist[k]:.0f}" for k in ("p50", "p90", "p99"))


def warm_up(base_url: str, vocab_high: int) -> None:
    run_serving(base_url, warmup_workload(vocab_high=vocab_high))


def run_system(name: str, args: argparse.Namespace, model: Path, rates: list[float], slo: Slo, vocab_high: int,
               llama: servers.LlamaCpp | None) -> dict:
    """Every configuration of one system: {config label: {"rungs": [...], "capacity_req_s": ...}}."""
    ctx_per_slot = max(args.max_prompt, args.doc_max_prompt if args.documents else 0) + args.output_tokens + 16
    if name == "conveyor":
        configs = {"conveyor": lambda port: servers.conveyor_command(
            port, model=str(model), threads=args.threads, dtype=None, quantization=None,
            extra=shlex.split(args.conveyor_args))}
    else:
        assert llama is not None
        configs = {f"llama-server -np {p}": (lambda port, p=p: llama.command(
            port, model, parallel=p, ctx_per_slot=ctx_per_slot, threads=args.threads))
            for p in args.llama_parallel}
    out: dict[str, dict] = {}
    for label, command in configs.items():
        port = servers.free_port()
        cmd = command(port)
        log = args.log_dir / f"{label.replace(' ', '_')}.log"
        with servers.launched(cmd, port, log) as server:
            warm_up(server.base_url, vocab_high)
            rungs = climb(server.base_url, rates, args, slo, vocab_high, label)
        out[label] = {"command": cmd, "rungs": rungs, "capacity_req_s": capacity_of(rungs)}
        if args.documents:
            out[label]["capacity_by_class_req_s"] = {name: capacity_of(rungs, name) for name in ("chat", "document")}
        print(f"  {label}: capacity {out[label]['capacity_req_s']:.2f} req/s", flush=True)
    return out


def best(configs: dict[str, dict]) -> tuple[str, float]:
    label = max(configs, key=lambda k: configs[k]["capacity_req_s"])
    return label, configs[label]["capacity_req_s"]


def plot(results: dict[str, dict[str, dict]], slo: Slo, title: str, path: Path) -> str | None:
    """Attainment against rate, one line per system configuration; the SLO's attainment as a line."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for system, configs in results.items():
        best_label = best(configs)[0] if configs else None
        for label, result in configs.items():
            rates = [r["rate_req_s"] for r in result["rungs"]]
            attained = [100 * r["attainment"] for r in result["rungs"]]
            is_best = label == best_label
            ax.plot(rates, attained, marker="o", linewidth=2.2 if is_best else 1.0, alpha=1.0 if is_best else 0.5,
                    label=f"{label} (capacity {result['capacity_req_s']:.2f} req/s)")
    ax.axhline(100 * slo.attainment, color="black", linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ticks = sorted({r["rate_req_s"] for configs in results.values() for res in configs.values() for r in res["rungs"]})
    ax.set_xticks(ticks, [f"{t:.2g}" for t in ticks], rotation=45, fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("requests meeting the SLO (%)")
    ax.set_ylim(0, 102)
    ax.set_title(f"{title}\n{slo.describe()}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    servers.add_system_arguments(p, "capacity")
    p.add_argument("--rates", default=",".join(map(str, DEFAULT_RATES)), help="the ladder, req/s, ascending")
    p.add_argument("--ttft-ms", type=float, default=2000.0)
    p.add_argument("--tpot-ms", type=float, default=150.0)
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLO")
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=300)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rung-s", type=float, default=60.0, help="seconds of arrivals per rung")
    p.add_argument("--min-requests", type=int, default=24, help="fewest requests in a rung")
    p.add_argument("--refine", type=int, default=1, help="rungs bisecting between the last met and first missed rate")
    p.add_argument("--llama-parallel", default="4,8,16", help="llama-server -np values searched")
    p.add_argument("--documents", type=float, default=0.0,
                   help="share of requests that are documents (a mixed workload; 0 = every request a chat)")
    p.add_argument("--doc-min-prompt", type=int, default=2000)
    p.add_argument("--doc-max-prompt", type=int, default=6000)
    p.add_argument("--doc-ttft-ms", type=float, default=20000.0, help="the documents' TTFT target")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    from bench.kernels.limits import model_arch

    model, chosen, llama = servers.resolve_systems(args)
    rates = sorted(float(r) for r in args.rates.split(","))
    args.llama_parallel = [int(p) for p in str(args.llama_parallel).split(",")]
    slo = Slo(args.ttft_ms / 1000, args.tpot_ms / 1000, args.attainment)
    vocab_high = min(40_000, model_arch(str(model)).vocab_size)
    print(f"CPU: {report.machine()['lscpu']}; threads {args.threads}; {model.name}; {slo.describe()}; "
          f"prompts {args.min_prompt}-{args.max_prompt} tokens, {args.output_tokens} out", flush=True)
    results = {name: run_system(name, args, model, rates, slo, vocab_high, llama) for name in chosen}
    summary = {name: dict(zip(("best", "capacity_req_s"), best(configs))) for name, configs in results.items()}
    if args.documents:
        for name, configs in results.items():   # each class's best over the system's configurations
            summary[name]["capacity_by_class_req_s"] = {c: max(config["capacity_by_class_req_s"][c]
                                                             for config in configs.values())
                                                         for c in ("chat", "document")}
    if "conveyor" in summary and "llama-server" in summary and summary["llama-server"]["capacity_req_s"] > 0:
        summary["ratio"] = summary["conveyor"]["capacity_req_s"] / summary["llama-server"]["capacity_req_s"]
    for name, s in summary.items():
        print(f"{name}: {s}" if name == "ratio" else f"{name}: capacity {s['capacity_req_s']:.2f} req/s ({s['best']})"
              + (f", by class {s['capacity_by_class_req_s']}" if "capacity_by_class_req_s" in s else ""))
    out = report.save_run("capacity", args.out_dir, {
        "model": str(model), "threads": args.threads, "rates": rates, "slo": vars(slo),
        "workload": {"min_prompt": args.min_prompt, "max_prompt": args.max_prompt, "documents": args.documents,
                     "doc_min_prompt": args.doc_min_prompt, "doc_max_prompt": args.doc_max_prompt,
                     "doc_ttft_ms": args.doc_ttft_ms,
                     "output_tokens": args.output_tokens, "rung_s": args.rung_s,
                     "min_requests": args.min_requests, "refine": args.refine, "seed": args.seed},
        "llama_commit": llama.commit() if llama else None, "summary": summary, "results": results})
    png = plot(results, slo, f"capacity under an SLO: {model.name}, {args.threads} threads", out.with_suffix(".png"))
    if png:
        print(f"PNG: {png}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench capacity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    run(p.parse_args(argv))
