"""`python -m bench run`: conveyor against its peers on one seeded workload, in one run.

Every system gets the same token-id prompts (uniform lengths, exactly `--output-tokens` out with
ignore_eos, all submitted at once) and the same thread count; systems run one after another, never
at the same time. Servers are started on a free loopback port and stopped after their run.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from bench import report
from bench.kernels import limits
from bench.peers import conveyor_offline, hf_peers
from bench.serving import servers
from bench.serving.client import run_serving
from bench.serving.metrics import samples, summarize
from bench.workloads import OfflineRequest, add_workload_arguments, offline_workload, warmup_workload
from conveyor.model.checkpoint import is_gguf

FAMILIES = ("conveyor", "conveyor-server", "llama-server-f32", "llama-server-q8_0", "llama-server-q4_1",
            "llama-server-model", "hf-sequential", "hf-static", "hf-generate-batch")
LLAMA_FAMILIES = ("llama-server-f32", "llama-server-q8_0", "llama-server-q4_1")   # the bundled model's files
MODEL_PEER = "llama-server-model"   # llama-server on the --model GGUF file itself: what any llama family means then
ALIASES = {"all": tuple(f for f in FAMILIES if f != MODEL_PEER),
           "hf": ("hf-sequential", "hf-static", "hf-generate-batch"), "llama-server": LLAMA_FAMILIES}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", default="all",
                   help=f"comma list of {', '.join(FAMILIES)}; or all, hf, llama-server (default: all)")
    p.add_argument("--model", default=None,
                   help="GGUF file or HF folder (default: the bundled SmolLM2 Q4_1 GGUF); llama-server then serves "
                        "this same GGUF file (system llama-server-model)")
    add_workload_arguments(p)
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every system")
    p.add_argument("--concurrency", default="1,16,32,64",
                   help="llama-server --parallel values; every request is sent at once (default: 1,16,32,64)")
    p.add_argument("--conveyor-seqs", default=None,
                   help="conveyor serve --max-num-seqs values, every request sent at once (default: the "
                        "--concurrency values above 1; single-request decode is measured by --single-requests)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="conveyor offline (default: largest --conveyor-seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--conveyor-dtype", default=None,
                   help="conveyor's --dtype (default: float32, the same weight values as llama.cpp's F32 file; "
                        "with --model FILE.gguf, conveyor's own default)")
    p.add_argument("--conveyor-quantization", default=None,
                   help="conveyor's --quantization, passed through (int8: compare with llama-server-q8_0; gguf: with "
                        "-q4_1; default: none, with --model FILE.gguf conveyor's own default)")
    p.add_argument("--hf-batch-sizes", default="8,16,32,64", help="transformers static batch sizes (best reported)")
    p.add_argument("--hf-cb-batch-tokens", default="256,512", help="generate_batch max_batch_tokens (best reported)")
    p.add_argument("--goodput-ttft-ms", type=float, default=2000.0)
    p.add_argument("--goodput-tpot-ms", type=float, default=250.0)
    p.add_argument("--single-requests", type=int, default=4,
                   help="requests run one at a time for conveyor's single-request decode rate (0 = skip)")
    p.add_argument("--logprobs", action="store_true", help="ask servers for logprobs to count streamed tokens")
    p.add_argument("--peers-dir", type=Path, default=servers.DEFAULT_PEERS_DIR, help="where build_llama_cpp.sh built")
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    p.add_argument("--no-limits", action="store_true", help="skip measuring the physical limit")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--log-dir", type=Path, default=Path("bench/results/run"), help="the servers' logs, one folder a run")


class Runner:
    """Runs the chosen systems in order, collecting figures keyed `family/config`."""

    def __init__(self, args: argparse.Namespace, stamp: str) -> None:
        self.args = args
        vocab_high = min(40_000, limits.model_arch(args.model).vocab_size)   # a small test model has a small vocab
        self.requests = offline_workload(args.num_requests, args.min_prompt, args.max_prompt, args.output_tokens,
                                         vocab_low=min(100, vocab_high // 4), vocab_high=vocab_high, seed=args.seed)
        self.warmup = warmup_workload(vocab_low=min(100, vocab_high // 4), vocab_high=vocab_high)
        self.concurrency = int_list(args.concurrency)
        self.conveyor_seqs = (int_list(args.conveyor_seqs) if args.conveyor_seqs
                              else [c for c in self.concurrency if c > 1] or self.concurrency)
        self.max_num_seqs = args.max_num_seqs or max(self.conveyor_seqs)
        self.results: dict[str, dict] = {}
        self.samples: dict[str, dict] = {}
        self.log_dir = args.log_dir / stamp
        self.slo = (args.goodput_ttft_ms / 1000, args.goodput_tpot_ms / 1000)
        self.single: dict | None = None
        self.conveyor_steps: dict | None = None

    def attempt(self, key: str, work: Callable[[], object]) -> None:
        """Run one system; a failure (a server that does not start, a crash) is recorded and the run goes on."""
        try:
            work()
        except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
            self.skip(key, f"failed: {type(exc).__name__}: {str(exc)[:1500]}")

    def skip(self, key: str, reason: str) -> None:
        self.results[key] = {"skipped": reason}
        tqdm.write(f"skipping {key}: {reason}")

    def record(self, key: str, fig: dict) -> None:
        # Our own run adds about --threads to it; more than the CPU count means another process competed.
        fig["load_average_1m_after"] = os.getloadavg()[0]
        self.results[key] = fig
        tqdm.write(f"{key:34s} {fig['output_tokens_per_s']:9.1f} output tok/s  ({fig['output_tokens']} tokens, "
                   f"{fig.get('elapsed_s', fig.get('duration_s', 0)):.1f} s)")

    def offline_figures(self, fig: dict, concurrency: int) -> dict:
        prompt_tokens = sum(len(r.prompt_token_ids) for r in self.requests)
        fig.setdefault("output_tokens_requested", sum(r.max_tokens for r in self.requests))
        fig.update(concurrency=concurrency, kind="offline", num_requests=len(self.requests),
                   output_tokens_per_s=fig["output_tokens"] / fig["elapsed_s"],
                   requests_per_s=len(self.requests) / fig["elapsed_s"],
                   total_tokens_per_s=(fig["output_tokens"] + prompt_tokens) / fig["elapsed_s"])
        return fig

    def progress(self, desc: str) -> tuple[tqdm, Callable[[], None]]:
        bar = tqdm(total=len(self.requests), desc=desc, unit="req", leave=False, disable=None)
        return bar, lambda: bar.update(1)

    def serve(self, key: str, base_url: str, requests: list[OfflineRequest], concurrency: int | None) -> dict:
        run_serving(base_url, self.warmup, seed=self.args.seed)
        bar, tick = self.progress(key)
        with bar:
            run = run_serving(base_url, requests, seed=self.args.seed, logprobs=self.args.logprobs, on_done=tick)
        fig = summarize(run, *self.slo)
        fig.update(kind="serving", concurrency=concurrency)
        self.samples[key] = samples(run)
        self.record(key, fig)
        return fig

    # ---------------------------------------------------------------- conveyor

    def conveyor(self) -> None:
        a = self.args
        max_num_seqs = self.max_num_seqs
        llm = conveyor_offline.make_llm(a.model, a.threads, max_num_seqs, a.max_num_batched_tokens, a.kv_cache_memory,
                                        a.conveyor_dtype, a.conveyor_quantization)
        bar, tick = self.progress("conveyor")
        with bar:
            fig = conveyor_offline.run(llm, self.requests, self.warmup, on_done=tick)
        fig.update(max_num_seqs=max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens)
        self.conveyor_steps = fig["decode_steps"]
        self.record("conveyor", self.offline_figures(fig, max_num_seqs))
        if a.single_requests > 0:
            self.single = conveyor_offline.single_stream_decode(llm, self.requests[:a.single_requests])
            tqdm.write(f"conveyor single-request decode: {self.single['decode_tokens_per_s']:.1f} tok/s "
                       f"(mean of {self.single['num_requests']} requests)")
        del llm
        gc.collect()

    def conveyor_server(self, concurrency: int) -> dict:
        a = self.args
        port = servers.free_port()
        cmd = servers.conveyor_command(port, model=a.model, threads=a.threads, max_num_seqs=concurrency,
                                       max_num_batched_tokens=a.max_num_batched_tokens,
                                       kv_cache_memory=a.kv_cache_memory, dtype=a.conveyor_dtype,
                                       quantization=a.conveyor_quantization)
        key = f"conveyor-server/c{concurrency}"
        with servers.launched(cmd, port, self.log_dir / f"{key.replace('/', '_')}.log") as server:
            fig = self.serve(key, server.base_url, self.requests, concurrency)
        fig["command"] = shlex.join(cmd)
        return fig

    # ---------------------------------------------------------------- llama.cpp

    def llama_ggufs(self) -> tuple[servers.LlamaCpp | None, dict[str, Path | str]]:
        """The llama.cpp build and the GGUF for each of its families, or the reason a family cannot run."""
        llama = servers.LlamaCpp.find(self.args.peers_dir)
        if llama is None:
            hint = servers.BUILD_HINT if self.args.peers_dir == servers.DEFAULT_PEERS_DIR else \
                f"{servers.BUILD_HINT} {self.args.peers_dir}"
            reason = f"llama-server not found under {self.args.peers_dir}: {hint}"
            return None, dict.fromkeys((*LLAMA_FAMILIES, MODEL_PEER), reason)
        if self.args.model is not None:
            path = Path(self.args.model)
            return llama, {MODEL_PEER: path if is_gguf(path) else f"llama-server needs a GGUF file, not {path}"}
        from conveyor.model.checkpoint import default_model_path

        made = {"llama-server-f32": llama.f32_gguf, "llama-server-q8_0": llama.q8_0_gguf}
        ggufs: dict[str, Path | str] = {family: path if path.is_file() else f"{path} not found: {servers.BUILD_HINT}"
                                        for family, path in made.items()}
        return llama, {**ggufs, "llama-server-q4_1": default_model_path()}

    def llama_server(self, llama: servers.LlamaCpp, family: str, gguf: Path, parallel: int) -> dict:
        port = servers.free_port()
        longest = max(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)
        cmd = llama.command(port, gguf, parallel=parallel, ctx_per_slot=longest, threads=self.args.threads)
        key = f"{family}/p{parallel}"
        with servers.launched(cmd, port, self.log_dir / f"{key.replace('/', '_')}.log") as server:
            fig = self.serve(key, server.base_url, self.requests, parallel)
        fig["command"] = shlex.join(cmd)
        return fig

    # ---------------------------------------------------------------- transformers

    def transformers(self, families: list[str], model_path: Path) -> None:
        a = self.args
        model = hf_peers.load(model_path, a.threads)
        if "hf-sequential" in families:
            bar, tick = self.progress("hf-sequential")
            with bar:
                fig = hf_peers.run_sequential(model, self.requests, self.warmup, on_done=tick)
            self.record("hf-sequential", self.offline_figures(fig, 1))
        if "hf-static" in families:
            for size in sorted({min(s, len(self.requests)) for s in int_list(a.hf_batch_sizes)}):
                bar, tick = self.progress(f"hf-static/b{size}")
                with bar:
                    fig = hf_peers.run_static(model, self.requests, self.warmup, size, on_done=tick)
                self.record(f"hf-static/b{size}", self.offline_figures(fig, size))
        if "hf-generate-batch" in families:
            for tokens in int_list(a.hf_cb_batch_tokens):
                key = f"hf-generate-batch/t{tokens}"
                try:
                    fig = hf_peers.run_generate_batch(model, self.requests, self.warmup, tokens)
                except Exception as exc:   # a peer's failure is a figure of the run, not the end of it
                    self.skip(key, f"generate_batch failed: {type(exc).__name__}: {exc}")
                    continue
                self.record(key, self.offline_figures(fig, len(self.requests)))
        del model
        gc.collect()


def peer_family(args: argparse.Namespace) -> str:
    """The llama-server family whose weights match conveyor's in this run (gguf: the bundled Q4_1 file;
    with --model FILE.gguf: that file; an HF folder is compared as float32 weights, like the bundled model)."""
    if args.model is not None and is_gguf(Path(args.model)):
        return MODEL_PEER
    return {"int8": "llama-server-q8_0", "gguf": "llama-server-q4_1"}.get(args.conveyor_quantization,
                                                                       "llama-server-f32")


def resolve_conveyor_options(args: argparse.Namespace) -> None:
    """Unset --conveyor-dtype/--conveyor-quantization: float32 weights (the F32 peer's) on the bundled model
    or an HF folder; with --model FILE.gguf, None: the flag is not passed and conveyor runs the file as
    it would by default, as llama-server does."""
    if args.model is None or not is_gguf(Path(args.model)):
        args.conveyor_dtype = args.conveyor_dtype or "float32"
        args.conveyor_quantization = args.conveyor_quantization or "none"


def selected_families(text: str, model: str | None = None) -> list[str]:
    """The systems to run; with --model every llama-server family is llama-server-model (one file to serve)."""
    chosen: list[str] = []
    for name in (s.strip() for s in text.split(",") if s.strip()):
        for family in ALIASES.get(name, (name,)):
            if family not in FAMILIES:
                raise SystemExit(f"unknown system {family!r}; known: {', '.join(FAMILIES)} (or all, hf, llama-server)")
            if model is not None and family in LLAMA_FAMILIES:
                family = MODEL_PEER
            elif model is None and family == MODEL_PEER:
                raise SystemExit(f"{MODEL_PEER} serves the --model GGUF file: give --model FILE")
            if family not in chosen:
                chosen.append(family)
    return chosen


def run(args: argparse.Namespace) -> dict:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    families = selected_families(args.systems, args.model)
    resolve_conveyor_options(args)
    runner = Runner(args, stamp)
    document: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                      "machine": report.machine(), "families": families}
    llama, ggufs = runner.llama_ggufs() if any(f.startswith("llama") for f in families) else (None, {})
    document["versions"] = report.versions(llama.commit() if llama else None)
    document["workload"] = {
        "num_requests": args.num_requests, "output_tokens": args.output_tokens, "seed": args.seed,
        "prompt_lengths": [len(r.prompt_token_ids) for r in runner.requests],
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in runner.requests),
        "threads": args.threads, "llama_parallel": runner.concurrency, "conveyor_seqs": runner.conveyor_seqs,
        "conveyor_dtype": args.conveyor_dtype, "conveyor_quantization": args.conveyor_quantization}
    load = os.getloadavg()[0]
    if load > document["machine"]["usable_cpus"]:
        tqdm.write(f"warning: load average {load:.1f} on {document['machine']['usable_cpus']} CPUs before the run; "
                   "other processes compete for the cores, so figures will be noisy")
    hf_families = [f for f in families if f.startswith("hf-")]
    llama_runs = [(f, p) for f in families if f.startswith("llama") for p in runner.concurrency]
    total = (("conveyor" in families) + len(runner.conveyor_seqs) * ("conveyor-server" in families)
             + len(llama_runs) + bool(hf_families) + (not args.no_limits))
    outer = tqdm(total=total, desc="systems", unit="run", disable=None)

    if not args.no_limits:
        outer.set_postfix_str("physical limit")
        batch_sizes = sorted({1, *runner.conveyor_seqs, min(args.num_requests, runner.max_num_seqs)})
        document["limits"] = limits.measure(args.model, args.threads, batch_sizes)
        outer.update(1)
    if "conveyor" in families:
        outer.set_postfix_str("conveyor")
        runner.attempt("conveyor", runner.conveyor)
        outer.update(1)
    if "conveyor-server" in families:
        for c in runner.conveyor_seqs:
            outer.set_postfix_str(f"conveyor-server c{c}")
            runner.attempt(f"conveyor-server/c{c}", lambda c=c: runner.conveyor_server(c))
            outer.update(1)
    for family, parallel in llama_runs:
        outer.set_postfix_str(f"{family} p{parallel}")
        target = ggufs[family]
        if isinstance(target, str):
            if family not in runner.results:
                runner.skip(family, target)
        else:
            runner.attempt(f"{family}/p{parallel}",
                           lambda f=family, t=target, p=parallel: runner.llama_server(llama, f, t, p))
        outer.update(1)
    if hf_families:
        outer.set_postfix_str("transformers")
        reason = hf_peers.missing()
        if reason:
            for f in hf_families:
                runner.skip(f, reason)
        else:
            from conveyor.model.checkpoint import resolve_model_path

            runner.transformers(hf_families, resolve_model_path(args.model))
        outer.update(1)
    outer.close()
    return finish(args, runner, document, stamp)


def finish(args: argparse.Namespace, runner: Runner, document: dict, stamp: str) -> dict:
    results = runner.results
    base_key = "conveyor" if results.get("conveyor", {}).get("output_tokens_per_s") else \
        f"conveyor-server/c{max(runner.conveyor_seqs)}"
    report.add_ratios(results, base_key)
    floor = None
    # The floor is float32 weights' (their bytes, torch's float32 matmul rate): it bounds nothing else.
    if "limits" in document and (args.conveyor_dtype, args.conveyor_quantization) != ("float32", "none"):
        document["limits"]["note"] = "floor of float32 weights; not compared with conveyor's " + \
            (args.conveyor_quantization if args.conveyor_quantization not in (None, "none")
             else args.conveyor_dtype or "default weights")
    elif "limits" in document:
        lim = document["limits"]
        max_seqs = runner.max_num_seqs
        floor = limits.workload_floor(document["workload"]["prompt_lengths"], args.output_tokens, max_seqs,
                                      lim["params"], lim["bandwidth"]["used_bytes_per_s"], lim["matmul_flops_per_s"])
        lim["workload_floor"] = floor
        if runner.conveyor_steps:
            lim["conveyor_decode_steps"] = limits.compare_steps(lim, runner.conveyor_steps)
    single = dict(runner.single or {})
    peer = peer_family(args)
    llama_p1 = results.get(f"{peer}/p1", {})
    document.update(results=results, base=base_key,
                    single_request_decode={"conveyor": single or None,
                                           f"{peer}/p1_tok_s": 1000 / llama_p1["tpot_ms"]["mean"]
                                           if llama_p1.get("tpot_ms", {}).get("mean") else None},
                    goals=report.goals(results, base_key, floor, runner.single, peer),
                    samples=runner.samples, finished=time.strftime("%Y-%m-%d %H:%M:%S %z"))
    if not args.no_plots:
        document["plots"] = report.plots(results, runner.samples, args.out_dir / f"run-{stamp}")
    report.print_summary(document, None)
    fields = {key: value for key, value in document.items() if key not in ("machine", "versions")}
    report.save_run("run", args.out_dir, fields, document["versions"]["llama.cpp"], stamp=stamp,
                    machine_info=document["machine"])
    return document


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    run(p.parse_args(argv))
