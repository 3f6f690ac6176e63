"""Head-of-line blocking: does a short request wait behind another's long prompt?

    python -m bench head-of-line --model FILE.gguf            # conveyor serve, its defaults, 2 threads
    python -m bench head-of-line --model FILE.gguf --conveyor-root ../main   # another tree's conveyor

One server; after a warm-up, two runs, each with a long prompt of its own (no prefix cache helps):
"alone", the --long-prompt tokens prompt by itself; "with short", the same length again and, --delay-s
seconds after it, a --short-prompt tokens request. Reported: the short request's TTFT (from its own
send), the long prompt's TTFT in both runs and their ratio. Token-id prompts, streamed, greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import time
from pathlib import Path

import httpx

from bench import report
from bench.serving import servers
from bench.serving.interference import _stream
from bench.workloads import offline_workload


async def _ttft_s(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> float:
    times: list[float] = []
    sent = time.perf_counter()
    await _stream(client, url, prompt, max_tokens, times)
    if not times:
        raise RuntimeError("no token came back")
    return times[0] - sent


async def _measure(base_url: str, args: argparse.Namespace, vocab_high: int, seed: int, with_short: bool) -> dict:
    url = base_url.rstrip("/") + "/v1/completions"
    long_prompt = offline_workload(1, args.long_prompt, args.long_prompt, 1, vocab_high=vocab_high,
                                   seed=seed)[0].prompt_token_ids
    short_prompt = offline_workload(1, args.short_prompt, args.short_prompt, 1, vocab_high=vocab_high,
                                    seed=seed + 1)[0].prompt_token_ids
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout_s, connect=30.0)) as client:
        long_task = asyncio.create_task(_ttft_s(client, url, long_prompt, 1))
        short_ttft_s = None
        if with_short:
            await asyncio.sleep(args.delay_s)
            short_ttft_s = await _ttft_s(client, url, short_prompt, args.short_tokens)
        return {"long_ttft_s": await long_task, "short_ttft_s": short_ttft_s}


def run(args: argparse.Namespace) -> dict:
    from bench.kernels.limits import model_arch

    root = args.conveyor_root.resolve() if args.conveyor_root else None
    if root is not None:
        os.environ["PYTHONPATH"] = str(root)   # the server's conveyor, not this tree's
    model, _, _ = servers.resolve_systems(argparse.Namespace(**{**vars(args), "systems": "conveyor"}))
    vocab_high = min(40_000, model_arch(str(model)).vocab_size)
    port = servers.free_port()
    cmd = servers.conveyor_command(port, model=str(model), threads=args.threads, dtype=None, quantization=None,
                                   extra=shlex.split(args.conveyor_args))
    print(f"CPU: {report.machine()['lscpu']}; threads {args.threads}; {model.name}; a {args.short_prompt}-token "
          f"request {args.delay_s} s after a {args.long_prompt}-token prompt", flush=True)
    with servers.launched(cmd, port, args.log_dir / "conveyor.log", cwd=root) as server:
        warm = argparse.Namespace(**{**vars(args), "long_prompt": min(args.long_prompt, 1024), "delay_s": 0.5})
        asyncio.run(_measure(server.base_url, warm, vocab_high, args.seed + 100, with_short=True))
        alone = asyncio.run(_measure(server.base_url, args, vocab_high, args.seed, with_short=False))
        mixed = asyncio.run(_measure(server.base_url, args, vocab_high, args.seed + 10, with_short=True))
    figures = {"short_ttft_s": mixed["short_ttft_s"], "long_ttft_alone_s": alone["long_ttft_s"],
               "long_ttft_with_short_s": mixed["long_ttft_s"],
               "long_ttft_ratio": mixed["long_ttft_s"] / alone["long_ttft_s"]}
    print(f"  short request TTFT {figures['short_ttft_s']:.2f} s; long prompt TTFT alone "
          f"{figures['long_ttft_alone_s']:.2f} s, with the short one {figures['long_ttft_with_short_s']:.2f} s "
          f"({figures['long_ttft_ratio']:.2f}x)", flush=True)
    report.save_run("head-of-line", args.out_dir, {
        "model": str(model), "threads": args.threads, "long_prompt": args.long_prompt,
        "short_prompt": args.short_prompt, "short_tokens": args.short_tokens, "delay_s": args.delay_s,
        "conveyor_root": str(args.conveyor_root or ""), "server_command": cmd, **figures})
    return figures


def add_arguments(p: argparse.ArgumentParser) -> None:
    servers.add_system_arguments(p, "head_of_line")
    p.add_argument("--long-prompt", type=int, default=4000, help="tokens of the long prompt")
    p.add_argument("--short-prompt", type=int, default=16, help="tokens of the short request")
    p.add_argument("--short-tokens", type=int, default=16, help="the short request's max_tokens")
    p.add_argument("--delay-s", type=float, default=2.0, help="seconds between the long prompt and the short one")
    p.add_argument("--conveyor-root", type=Path, default=None,
                   help="run the server from this source tree (its directory and PYTHONPATH), e.g. for a "
                        "before/after pair")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench head-of-line", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    run(p.parse_args(argv))
