"""Long-prompt interference: what a long prompt's prefill does to the streams already decoding.

    python -m bench interference                       # the bundled model, conveyor vs llama-server
    python -m bench interference --model FILE.gguf --long-prompt 4096 --streams 8

Per system: --streams requests start decoding (short prompts, long outputs, streamed); once every one
of them has streamed for --before-s seconds, one prompt of --long-prompt tokens arrives. The streams'
inter-token gaps are split at the long prompt's arrival and at its first token: "before" (steady
decoding) and "during" (its prefill). A control run then streams the same requests alone as long: its
gaps at the same token positions show what the streams' growing contexts alone do to their pace.
Reported: p50/p99 ITL before, during and in the control, the during/before and during/control p99
ratios, and the long prompt's TTFT. conveyor runs `conveyor serve` with its defaults; llama-server serves the same file with
one slot per request (-np streams + 1), each with room for the long prompt. JSON and a plot of every
gap against time go to --out-dir.
"""

from __future__ import annotations

import argparse
import shlex
import asyncio
import json
import time
from pathlib import Path

import httpx

from bench import report
from bench.serving import servers
from bench.serving.client import sse_lines
from bench.serving.metrics import percentile
from bench.workloads import offline_workload



async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                  times: list[float], first_token: asyncio.Event | None = None) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in sse_lines(response):
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if any(c.get("text") for c in chunk.get("choices") or []):
                times.append(time.perf_counter())
                if first_token is not None and not first_token.is_set():
                    first_token.set()


async def _measure(base_url: str, args: argparse.Namespace, vocab_high: int, run_for_s: float | None = None) -> dict:
    """The streams, then the long prompt; or, with `run_for_s`, the control: the same streams alone for
    that long (the same token positions, without the long prompt)."""
    url = base_url.rstrip("/") + "/v1/completions"
    short = offline_workload(args.streams, args.stream_prompt, args.stream_prompt, args.stream_tokens,
                             vocab_high=vocab_high, seed=args.seed)
    long_prompt = offline_workload(1, args.long_prompt, args.long_prompt, 1, vocab_high=vocab_high,
                                   seed=args.seed + 1)[0].prompt_token_ids
    times: list[list[float]] = [[] for _ in short]
    limits = httpx.Limits(max_connections=args.streams + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        start = time.perf_counter()
        streams = [asyncio.create_task(_stream(client, url, r.prompt_token_ids, r.max_tokens, t))
                   for r, t in zip(short, times)]
        while not all(len(t) >= 2 for t in times):          # every stream decoding
            if any(s.done() for s in streams):
                [s.result() for s in streams if s.done()]   # surfaces the error
                raise RuntimeError("a stream ended before every stream was decoding")
            await asyncio.sleep(0.01)
        steady = time.perf_counter()
        long_task = None
        if run_for_s is None:
            await asyncio.sleep(args.before_s)
            long_first = asyncio.Event()
            long_sent = time.perf_counter()
            long_task = asyncio.create_task(_stream(client, url, long_prompt, 1, [], long_first))
            await asyncio.wait_for(long_first.wait(), timeout=args.timeout_s)
            long_first_s = time.perf_counter()
        else:
            await asyncio.sleep(run_for_s)
            long_sent = long_first_s = time.perf_counter()
        ended_early = any(task.done() for task in streams)
        await asyncio.sleep(args.after_s)
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, *([long_task] if long_task else []), return_exceptions=True)
    if ended_early:
        raise RuntimeError("a stream ended before the long prompt's prefill did: raise --stream-tokens")
    return {"times": [[t - start for t in ts] for ts in times], "steady_s": steady - start,
            "window_s": [long_sent - start, long_first_s - start]}


def figures(run: dict, control: dict) -> dict:
    """ITL before the long prompt and during its prefill; and the control's ITL over the same token
    positions of each stream (what the streams' growing contexts alone do to their pace)."""
    (sent, first), steady = run["window_s"], run["steady_s"]
    before, during, matched = [], [], []
    for ts, control_ts in zip(run["times"], control["times"]):
        for i in range(1, len(ts)):
            if steady < ts[i] <= sent:
                before.append(ts[i] - ts[i - 1])
            elif sent < ts[i] <= first:
                during.append(ts[i] - ts[i - 1])
                if i < len(control_ts):
                    matched.append(control_ts[i] - control_ts[i - 1])
    fig = {"itl_before_ms": _dist(before), "itl_during_ms": _dist(during), "itl_control_same_tokens_ms": _dist(matched),
           "long_prompt_ttft_ms": (first - sent) * 1000, "num_gaps_before": len(before),
           "num_gaps_during": len(during), "num_gaps_control": len(matched)}
    fig["p99_ratio"] = fig["itl_during_ms"]["p99"] / fig["itl_before_ms"]["p99"]
    fig["p99_ratio_to_control"] = fig["itl_during_ms"]["p99"] / fig["itl_control_same_tokens_ms"]["p99"]
    fig["gaps"] = [(round(b, 4), round((b - a) * 1000, 2)) for ts in run["times"] for a, b in zip(ts, ts[1:])]
    fig["window_s"] = [round(sent, 4), round(first, 4)]
    return fig


def _dist(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"p50": percentile(ms, 50), "p90": percentile(ms, 90), "p99": percentile(ms, 99),
            "max": max(ms, default=float("nan"))}


def run_system(name: str, args: argparse.Namespace, model: Path, vocab_high: int,
               llama: servers.LlamaCpp | None) -> dict:
    port = servers.free_port()
    if name == "conveyor":
        cmd = servers.conveyor_command(port, model=str(model), threads=args.threads, dtype=None, quantization=None,
                                          extra=shlex.split(args.conveyor_args))
    else:
        assert llama is not None
        ctx = max(args.long_prompt, args.stream_prompt + args.stream_tokens) + 16
        cmd = llama.command(port, model, parallel=args.streams + 1, ctx_per_slot=ctx, threads=args.threads)
    with servers.launched(cmd, port, args.log_dir / f"{name}.log") as server:
        asyncio.run(_measure(server.base_url, _warmup_args(args), vocab_high))   # warm, then measure
        run = asyncio.run(_measure(server.base_url, args, vocab_high))
        control = asyncio.run(_measure(server.base_url, args, vocab_high, run_for_s=run["window_s"][1] - run["steady_s"]))
    fig = figures(run, control)
    fig["command"] = cmd
    print(f"  {name:14s} ITL p50/p99 before {fig['itl_before_ms']['p50']:.0f}/{fig['itl_before_ms']['p99']:.0f} ms,"
          f" during {fig['itl_during_ms']['p50']:.0f}/{fig['itl_during_ms']['p99']:.0f} ms (p99 ratio "
          f"{fig['p99_ratio']:.2f}x; the same tokens without the long prompt "
          f"{fig['itl_control_same_tokens_ms']['p50']:.0f}/{fig['itl_control_same_tokens_ms']['p99']:.0f} ms: "
          f"{fig['p99_ratio_to_control']:.2f}x); long prompt TTFT {fig['long_prompt_ttft_ms']:.0f} ms", flush=True)
    return fig


def _warmup_args(args: argparse.Namespace) -> argparse.Namespace:
    """A short pass of the same shape (the same long prompt length: its first run pays one-off costs)."""
    return argparse.Namespace(**{**vars(args), "before_s": 0.5, "after_s": 0.0, "seed": args.seed + 7})


def plot(results: dict[str, dict], title: str, path: Path) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 3 * len(results)), sharey=True, squeeze=False)
    for ax, (name, result) in zip(axes[:, 0], results.items()):
        ends, gaps = zip(*result["gaps"]) if result["gaps"] else ((), ())
        ax.scatter(ends, gaps, s=4)
        ax.axvspan(*result["window_s"], color="orange", alpha=0.2, label="the long prompt's prefill")
        ax.set_yscale("log")
        ax.set_ylabel("ITL (ms)")
        ax.set_title(f"{name}: p99 ITL {result['itl_before_ms']['p99']:.0f} ms before, "
                     f"{result['itl_during_ms']['p99']:.0f} ms during ({result['p99_ratio']:.2f}x); "
                     f"long prompt TTFT {result['long_prompt_ttft_ms']:.0f} ms", fontsize=8)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("seconds since the streams started")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    servers.add_system_arguments(p, "interference")
    p.add_argument("--streams", type=int, default=8, help="requests decoding when the long prompt arrives")
    p.add_argument("--stream-prompt", type=int, default=64, help="their prompt tokens")
    p.add_argument("--stream-tokens", type=int, default=4096, help="their output budget (cut off at the end)")
    p.add_argument("--long-prompt", type=int, default=4096, help="tokens of the prompt that arrives")
    p.add_argument("--before-s", type=float, default=5.0, help="seconds of steady decoding measured before it")
    p.add_argument("--after-s", type=float, default=0.5, help="seconds the streams run on after its first token")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    from bench.kernels.limits import model_arch

    model, chosen, llama = servers.resolve_systems(args)
    vocab_high = min(40_000, model_arch(str(model)).vocab_size)
    print(f"CPU: {report.machine()['lscpu']}; threads {args.threads}; {model.name}; {args.streams} streams, "
          f"then a {args.long_prompt}-token prompt", flush=True)
    results = {name: run_system(name, args, model, vocab_high, llama) for name in chosen}
    out = report.save_run("interference", args.out_dir, {
        "model": str(model), "threads": args.threads, "streams": args.streams,
        "stream_prompt": args.stream_prompt, "long_prompt": args.long_prompt, "before_s": args.before_s,
        "llama_commit": llama.commit() if llama else None, "results": results})
    png = plot(results, f"a {args.long_prompt}-token prompt arrives while {args.streams} streams decode: "
                        f"{model.name}, {args.threads} threads", out.with_suffix(".png"))
    if png:
        print(f"PNG: {png}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench interference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    run(p.parse_args(argv))
