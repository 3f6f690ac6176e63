"""conveyor serve and its peers on the GGUF files users bring, one system at a time, same threads.

    python -m bench real-models --model FILE.gguf [--model FILE2.gguf ...]
    python -m bench real-models --model FILE.gguf --quick      # fewer requests and tokens: a smoke pass
    python -m bench real-models --model FILE.gguf --peers-dir DIR --ik-dir IK_DIR

conveyor runs as `conveyor serve` with its defaults (engine core in its own process), given only
--threads (and --conveyor-quantization / --conveyor-kv-cache-memory / --conveyor-device when asked). The
peers serve the same file with the same threads: llama-server (`--cache-ram 0 -fit off`), ik_llama.cpp's
llama-server as ik-llama (`-cram 0 -cb`, flash attention its default) and ik-llama-rtr (the same with
-rtr: tensors repacked to interleaved rows at load). A peer not built is skipped. Per file and system:

  load     process start -> /health answers 200: the first start in this run, then a second (warm) start
           with the file in the page cache (the first start may find it cached by an earlier system)
  memory   peak RSS summed over the server and all its children, sampled every 50 ms through all of
           its starts; beside it the KV cache it was configured with (conveyor --kv-cache-memory,
           the peers' -c x f16 K and V per token), to check peak <= file + KV cache + 1 GiB
  decode   requests of 128 output tokens one at a time (peers -np 1): 1000 / mean TPOT
  prompt   a 512-token prompt alone: TTFT and prompt tokens / TTFT (median of the repeats)
  batch    16 requests at once (100-300 token prompts, 64 out): output tok/s; each peer's best -np of 4, 8, 16
  greedy   the greedy text of 8 chat prompts, up to 16 tokens or the end of the turn (the model's own
           tokenizer and chat template), conveyor's compared exactly with each peer's

Prompts are token ids (seeded), output fixed by ignore_eos. A table of every system's figures and
conveyor's ratio to the best peer per metric is printed; JSON (command, machine, versions, peer
commits) and a PNG of the figures go to --out-dir (docs/bench).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench import report
from bench.kernels.limits import model_arch, stream_read_bandwidth
from bench.peers.real_models_report import compare, peers_that_ran, plot, table
from bench.serving import servers
from bench.serving.client import ServingRun, greedy_text, run_serving
from bench.serving.metrics import summarize
from bench.workloads import OfflineRequest, offline_workload, warmup_workload
from conveyor.model.checkpoint import is_gguf

GIB = 1024 ** 3
MEMORY_INTERVAL_S = 0.05
SYSTEMS = ("conveyor", "llama-server", "ik-llama", "ik-llama-rtr")
CHAT_PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a string.",
                "Explain what a hash map is in one sentence.", "Name three prime numbers.",
                "What does HTTP stand for?", "Translate 'good morning' into Spanish.",
                "How many days are in a leap year?", "Write a haiku about the sea.")


@dataclass(frozen=True)
class Sizes:
    first_start: int = 1        # 0: no start before the warm one (no first-start load time; quicker)
    decode_requests: int = 4
    decode_tokens: int = 128
    prompt_tokens: int = 512
    prompt_repeats: int = 3
    batch_requests: int = 16
    batch_min_prompt: int = 100
    batch_max_prompt: int = 300
    batch_tokens: int = 64
    llama_parallel: tuple[int, ...] = (4, 8, 16)
    greedy_prompts: int = 8
    greedy_tokens: int = 16


QUICK = Sizes(decode_requests=1, decode_tokens=32, prompt_repeats=1, batch_requests=8, batch_tokens=16,
              llama_parallel=(8,), greedy_prompts=3)


def parse_sizes(quick: bool, settings: list[str]) -> Sizes:
    """--quick, then each --set NAME=VALUE (llama_parallel as a comma list)."""
    sizes = QUICK if quick else Sizes()
    names = [f.name for f in dataclasses.fields(Sizes)]
    for item in settings:
        name, _, value = item.partition("=")
        if name not in names:
            raise SystemExit(f"--set {item!r}: unknown name; known: {', '.join(names)}")
        parsed = tuple(int(v) for v in value.split(",")) if name == "llama_parallel" else int(value)
        sizes = dataclasses.replace(sizes, **{name: parsed})
    return sizes


@dataclass
class Server:
    """How to start one system on one file: its command for `parallel` slots and the KV bytes that buys."""

    name: str
    command: Callable[[int, int, int], list[str]]   # (port, parallel, ctx_per_slot) -> argv
    kv_bytes: Callable[[int, int], int | None]      # (parallel, ctx_per_slot) -> configured KV cache bytes
    sweeps_parallel: bool                           # llama-server: one start per -np; conveyor batches by itself


def conveyor_server(model: Path, args: argparse.Namespace) -> Server:
    from conveyor.config import DEFAULT_KV_CACHE_MEMORY, parse_bytes

    kv = parse_bytes(args.conveyor_kv_cache_memory or DEFAULT_KV_CACHE_MEMORY, "kv_cache_memory")
    return Server("conveyor", lambda port, _p, _c: servers.conveyor_command(
        port, model=str(model), threads=args.threads, dtype=None, quantization=args.conveyor_quantization,
        kv_cache_memory=args.conveyor_kv_cache_memory, extra=("--device", args.conveyor_device)),
        lambda _p, _c: kv, sweeps_parallel=False)


def llama_server(llama: servers.LlamaCpp | servers.IkLlama, model: Path, threads: int, arch,  # noqa: ANN001
                 log_dir: Path) -> Server:
    """llama-server or ik_llama's; `arch`: the file's ModelArch, None where conveyor cannot read it (the KV
    size goes unreported). ik_llama's trace log goes to `log_dir` (its last start's)."""
    per_token = arch.kv_bytes_per_token * 2 if arch is not None else None   # f16 K and V, both servers' default
    ik = isinstance(llama, servers.IkLlama)
    extra = {"trace_log": log_dir / f"{model.stem}-{llama.name}-trace"} if ik else {}
    name = llama.name if ik else "llama-server"
    command = lambda port, p, c: llama.command(port, model, parallel=p, ctx_per_slot=c,  # noqa: E731
                                               threads=threads, **extra)
    return Server(name, command, lambda p, c: p * c * per_token if per_token else None, sweeps_parallel=True)


def find_peers(args: argparse.Namespace) -> dict[str, servers.LlamaCpp | servers.IkLlama | str]:
    """Each peer's build, or why it is absent."""
    ik_dir = args.ik_dir or args.peers_dir / "ik"
    llama = servers.LlamaCpp.find(args.peers_dir)
    peers: dict[str, servers.LlamaCpp | servers.IkLlama | str] = {
        "llama-server": llama or f"llama-server not found under {args.peers_dir}/llama.cpp: {servers.BUILD_HINT}"}
    for name in ("ik-llama", "ik-llama-rtr"):
        ik = servers.IkLlama.find(ik_dir, repack=name == "ik-llama-rtr")
        peers[name] = ik or f"ik_llama.cpp's llama-server not found at {ik_dir}/build/bin: {servers.IK_BUILD_HINT}"
    return peers


def chat_prompts(model: Path, count: int) -> list[list[int]]:
    """Token ids of short chat turns, from the file's own tokenizer and chat template (raw text without one)."""
    from conveyor.text.tokenizer_loader import load_tokenizer

    tokenizer = load_tokenizer(model)
    prompts = []
    for text in (CHAT_PROMPTS * (count // len(CHAT_PROMPTS) + 1))[:count]:
        try:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
            prompts.append(tokenizer.encode(rendered, add_special_tokens=False))
        except ValueError:
            prompts.append(tokenizer.encode(text))
    return prompts


def served(base_url: str, requests: list[OfflineRequest], max_concurrency: int | None = None) -> ServingRun:
    """run_serving, all at once or `max_concurrency` at a time; a failed request fails the measurement."""
    run = run_serving(base_url, requests, max_concurrency=max_concurrency)
    errors = sorted({r.error for r in run.records if r.error})
    if errors or any(r.ttft_s is None for r in run.records):
        raise RuntimeError(f"requests to {base_url} failed: {errors or 'no output'}")
    return run


class Measurement:
    """Every start of one system on one file: load times, peak memory and the figures of each phase."""

    def __init__(self, server: Server, model: Path, sizes: Sizes, log_dir: Path, vocab_high: int) -> None:
        self.server, self.model, self.sizes, self.log_dir = server, model, sizes, log_dir
        self.vocab_high = vocab_high
        self.launches: list[dict] = []
        self.figures: dict = {"system": server.name}

    def start(self, label: str, parallel: int, ctx_per_slot: int):  # -> contextmanager of servers.Launched
        port = servers.free_port()
        cmd = self.server.command(port, parallel, ctx_per_slot)
        self.launches.append({"label": label, "command": shlex.join(cmd),
                              "kv_cache_bytes": self.server.kv_bytes(parallel, ctx_per_slot)})
        return servers.launched(cmd, port, self.log_dir / f"{self.model.stem}-{self.server.name}-{label}.log",
                                startup_timeout_s=600, poll_s=0.05, memory_interval_s=MEMORY_INTERVAL_S)

    def ended(self, launched: servers.Launched) -> None:
        memory = launched.memory
        self.launches[-1].update(load_s=launched.startup_s, peak_rss_bytes=memory.peak_bytes,
                                 memory_samples=memory.num_samples,
                                 process_peak_rss_bytes={("server" if pid == launched.process.pid else f"child {pid}"):
                                                         peak for pid, peak in memory.process_peak_bytes.items()})

    def workload(self, n: int, low: int, high: int, tokens: int, seed: int) -> list[OfflineRequest]:
        return offline_workload(n, low, high, tokens, vocab_low=min(100, self.vocab_high // 4),
                                vocab_high=self.vocab_high, seed=seed)

    def run(self, greedy_prompts: list[list[int]]) -> dict:
        s, fig = self.sizes, self.figures
        decode = self.workload(s.decode_requests, 100, 300, s.decode_tokens, seed=1)
        prompts = self.workload(s.prompt_repeats, s.prompt_tokens, s.prompt_tokens, 1, seed=3)
        ctx = max(s.prompt_tokens + 1, 300 + s.decode_tokens, max(map(len, greedy_prompts)) + s.greedy_tokens) + 16
        if s.first_start:
            with self.start("first", 1, ctx) as first:
                pass
            self.ended(first)
        with self.start("warm", 1, ctx) as server:
            served(server.base_url, warmup_workload(vocab_high=self.vocab_high))
            tpot = summarize(served(server.base_url, decode, max_concurrency=1))["tpot_ms"]["mean"]
            fig["decode_tok_s"] = 1000 / tpot
            ttfts = [served(server.base_url, [p]).records[0].ttft_s for p in prompts]
            fig["prompt_ttft_ms"] = 1000 * statistics.median(ttfts)
            fig["prompt_tok_s"] = s.prompt_tokens / statistics.median(ttfts)
            fig["greedy_texts"] = [self.greedy(server.base_url, p) for p in greedy_prompts]
            if not self.server.sweeps_parallel:
                fig["batch"] = self.batch(server.base_url)
        self.ended(server)
        fig["load_first_s"] = self.launches[0]["load_s"] if s.first_start else None
        fig["load_warm_s"] = self.launches[-1]["load_s"]
        if self.server.sweeps_parallel:
            by_parallel = {}
            for parallel in s.llama_parallel:
                with self.start(f"np{parallel}", parallel, s.batch_max_prompt + s.batch_tokens) as server:
                    by_parallel[parallel] = self.batch(server.base_url)
                self.ended(server)
            best = max(by_parallel, key=lambda p: by_parallel[p]["output_tok_s"])
            fig["batch"] = {**by_parallel[best], "best_parallel": best,
                            "by_parallel": {p: f["output_tok_s"] for p, f in by_parallel.items()}}
        fig["batch_output_tok_s"] = fig["batch"]["output_tok_s"]
        peak = max(self.launches, key=lambda launch: launch["peak_rss_bytes"])
        file_bytes = self.model.stat().st_size
        fig.update(peak_rss_gib=peak["peak_rss_bytes"] / GIB, peak_launch=peak["label"], launches=self.launches)
        if peak["kv_cache_bytes"] is not None:
            budget = file_bytes + peak["kv_cache_bytes"] + GIB
            fig.update(kv_cache_gib=peak["kv_cache_bytes"] / GIB, memory_budget_gib=budget / GIB,
                       memory_within_budget=peak["peak_rss_bytes"] <= budget)
        return fig

    def greedy(self, base_url: str, prompt: list[int]) -> str | None:
        """One greedy text, None where the server refuses it: a random-weights file can end on a broken
        UTF-8 sequence that a peer fails to serialize (ik_llama.cpp answers 500), and that must not cost
        the figures measured before it."""
        try:
            return greedy_text(base_url, prompt, self.sizes.greedy_tokens)
        except httpx.HTTPStatusError as exc:
            error = f"{exc.response.status_code}: {exc.response.text[:200]}"
            self.figures.setdefault("greedy_errors", []).append(error)
            return None

    def batch(self, base_url: str) -> dict:
        s = self.sizes
        requests = self.workload(s.batch_requests, s.batch_min_prompt, s.batch_max_prompt, s.batch_tokens, seed=2)
        served(base_url, warmup_workload(vocab_high=self.vocab_high))
        fig = summarize(served(base_url, requests))
        return {"output_tok_s": fig["output_tokens_per_s"], "output_tokens": fig["output_tokens"],
                "failed": fig["failed"], "ttft_p50_ms": fig["ttft_ms"]["p50"], "tpot_mean_ms": fig["tpot_ms"]["mean"]}


def decode_bytes_per_token(model: Path) -> int:
    """Weight bytes one decode step reads: every tensor but the token embedding (one row of it is read),
    which a tied file reads whole as its output layer."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(model)).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if name != "token_embd.weight" or tied)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench real-models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="a GGUF file; repeat for more")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of each system")
    p.add_argument("--quick", action="store_true", help="a short smoke pass: fewer requests and tokens")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help=f"override one size ({', '.join(f.name for f in dataclasses.fields(Sizes))})")
    p.add_argument("--conveyor-quantization", default=None, help="conveyor's --quantization (default: its own)")
    p.add_argument("--conveyor-kv-cache-memory", default=None, help="conveyor's --kv-cache-memory (default: its own)")
    p.add_argument("--conveyor-device", default="cpu", help="conveyor's --device (cuda: on a GPU)")
    p.add_argument("--peers-dir", type=Path, default=servers.DEFAULT_PEERS_DIR,
                   help="where build_llama_cpp.sh built (llama.cpp/build/bin/llama-server under it)")
    p.add_argument("--ik-dir", type=Path, default=None,
                   help="ik_llama.cpp's source tree, built in build/ (default: <peers-dir>/ik)")
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    p.add_argument("--log-dir", type=Path, default=Path("bench/results/real_models"))
    p.add_argument("--stream-bytes", type=int, default=2 << 30,
                   help="buffer of the stream read that one-stream decode is reported against (the wall)")
    args = p.parse_args(argv)
    sizes = parse_sizes(args.quick, args.set)
    chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(chosen) - set(SYSTEMS):
        raise SystemExit(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    peers = find_peers(args)
    print(f"CPU: {report.machine()['lscpu']}; threads {args.threads}; {sizes}", flush=True)
    results: dict[str, dict] = {}
    for model in map(Path, args.model):
        if not is_gguf(model):
            raise SystemExit(f"{model} is not a GGUF file")
        try:
            arch = model_arch(str(model))
        except (ValueError, KeyError, NotImplementedError) as exc:
            print(f"{model.name}: conveyor cannot read its shapes ({exc}); prompts use token ids below 32000")
            arch = None
        vocab_high = min(40_000, arch.vocab_size) if arch is not None else 32_000
        greedy = chat_prompts(model, sizes.greedy_prompts)
        systems: dict[str, dict] = {}
        for name in chosen:   # one after the other, never beside each other
            peer = peers.get(name)
            if isinstance(peer, str):
                systems[name] = {"skipped": peer}
                continue
            server = conveyor_server(model, args) if peer is None else \
                llama_server(peer, model, args.threads, arch, args.log_dir)
            measurement = Measurement(server, model, sizes, args.log_dir, vocab_high)
            try:
                systems[name] = measurement.run(greedy)
            except (RuntimeError, TimeoutError, OSError, ValueError, httpx.HTTPError) as exc:
                systems[name] = {"skipped": f"failed: {type(exc).__name__}: {str(exc)[:1500]}",
                                 "launches": measurement.launches}
        wall = stream_read_bandwidth(args.threads, args.stream_bytes)   # right after the systems: the same state
        per_token = decode_bytes_per_token(model)
        for fig in systems.values():
            if fig.get("decode_tok_s"):
                fig["decode_bytes_per_s"] = per_token * fig["decode_tok_s"]
                fig["decode_share_of_stream"] = fig["decode_bytes_per_s"] / wall
        results[model.name] = {"path": str(model), "file_bytes": model.stat().st_size, "systems": systems,
                               "comparison": compare(systems), "stream_read_bytes_per_s": wall,
                               "decode_bytes_per_token": per_token}
        print(table(model.name, model.stat().st_size, sizes, systems, results[model.name]["comparison"]), flush=True)
        print("  one-stream decode as a share of the C stream read of 2 GiB on the same threads "
              f"({wall / 1e9:.1f} GB/s; {per_token / 1e9:.2f} GB of weights read per token): "
              + ", ".join(f"{n} {f['decode_share_of_stream']:.0%}" for n, f in systems.items()
                          if f.get("decode_share_of_stream")), flush=True)
    llama = peers["llama-server"]
    out = report.save_run("real-models", args.out_dir, {
        "threads": args.threads, "sizes": dataclasses.asdict(sizes), "systems": chosen,
        "peers": {name: {"skipped": peer} if isinstance(peer, str) else
                  {"server": str(peer.server), "commit": peer.commit()}
                  for name, peer in peers.items() if name in chosen},
        "conveyor_quantization": args.conveyor_quantization or "conveyor's default",
        "conveyor_kv_cache_memory": args.conveyor_kv_cache_memory or "conveyor's default",
        "conveyor_device": args.conveyor_device,
        "memory_interval_s": MEMORY_INTERVAL_S, "results": results},
        llama.commit() if "llama-server" in chosen and not isinstance(llama, str) else None)
    if any(peers_that_ran(result["systems"]) for result in results.values()):
        png = plot(results, out.with_suffix(".png"))
        print(f"PNG: {png}" if png else "no PNG: matplotlib is not installed (pip install -e '.[bench]')")
