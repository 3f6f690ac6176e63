"""The 8-bit KV cache against float16, beside llama.cpp's q8_0 cache against its f16 one.

    nice -n 10 python -m bench kv-int8 --model /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --threads 2

(a) agreement: --num-prompts chat prompts, greedy, --agree-tokens tokens each; the share of prompts
    whose text is the same with the 8-bit cache as with the 16-bit one, for conveyor (`--kv-cache-dtype
    int8` vs `float16`) and for llama-server (`-ctk q8_0 -ctv q8_0` vs f16, both `-fa on`: a quantized V
    cache needs flash attention there);
(b) decode: --streams streams of distinct seeded random prompts of --context-tokens tokens, streamed at
    once; aggregate tokens per second over the window in which every stream is decoding (after the last
    first token, before the first last one), conveyor int8 vs float16 (llama-server is not timed here).
    Both servers run side by side (one idle while the other is timed): after one warm-up round, whose
    prompts the prefix cache then holds, --rounds rounds alternate between them, so a machine whose load
    changes meanwhile weighs on both alike; the figure is each one's median and the median of the
    per-round ratios;
(b') the attention kernel alone: one decode step's attention over every layer (--attention-shape: heads,
    kv heads, head dim, layers; the 0.5B file's by default) for --streams rows of --context-tokens
    tokens, float16 against int8 codes, alternating, in this process;
(c) capacity: tokens the KV cache holds per GiB, from the servers' own gauges (conveyor) and from
    ggml's block sizes (llama.cpp: q8_0 keeps 34 bytes per 32 values).
JSON goes to --out-dir with the command that reproduces it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import random
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench import report
from bench.serving import servers

PROMPTS = [
    "Write a Python function that reverses a string.", "What does the `yield` keyword do in Python?",
    "Write a SQL query that counts rows per day in a table named events.", "Explain what a mutex is.",
    "Write a bash one-liner that counts the lines of every .py file.", "What is a closure in JavaScript?",
    "Write a C function that returns the length of a string.", "How do I read a JSON file in Python?",
    "Explain big-O notation in one paragraph.", "Write a Rust function that adds two integers.",
    "What is the difference between a list and a tuple in Python?", "Write a regular expression for an email.",
    "How do I create a virtual environment in Python?", "Write a Go function that sums a slice of ints.",
    "What does git rebase do?", "Write a Python class for a stack.", "Explain recursion to a beginner.",
    "Write a JavaScript function that debounces another function.", "What is a hash table?",
    "Write a Python one-liner that flattens a list of lists.", "What is the purpose of a Dockerfile?",
    "Write a function that checks whether a number is prime.",
]


def chat_texts(base_url: str, prompts: list[str], max_tokens: int) -> list[str]:
    texts = []
    for prompt in prompts:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True}
        response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300)
        response.raise_for_status()
        texts.append(response.json()["choices"][0]["message"]["content"] or "")
    return texts


def stream_times(base_url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """perf_counter time of each streamed chunk with text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    times: list[float] = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or []
                if choices and choices[0].get("text"):
                    times.append(time.perf_counter())
    return times


def decode_rate(base_url: str, num_streams: int, context_tokens: int, output_tokens: int) -> dict:
    """Aggregate decode tokens per second while all streams decode."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(context_tokens)] for _ in range(num_streams)]
    with concurrent.futures.ThreadPoolExecutor(num_streams) as pool:
        runs = list(pool.map(lambda p: stream_times(base_url, p, output_tokens), prompts))
    if not all(runs):   # a stream whose few tokens decoded to no text yet (bytes of one character): no window
        return {"tok_s": None, "tokens_in_window": 0, "window_s": 0.0, "chunks_per_stream": [len(r) for r in runs]}
    start, end = max(r[0] for r in runs), min(r[-1] for r in runs)
    tokens = sum(sum(1 for t in r if start < t <= end) for r in runs)
    return {"tok_s": tokens / (end - start) if end > start else None, "tokens_in_window": tokens,
            "window_s": end - start, "chunks_per_stream": [len(r) for r in runs]}


def attention_ms(shape: str, rows: int, context: int, threads: int, reps: int = 21) -> dict[str, float]:
    """Median milliseconds of one decode step's attention over all layers, per KV cache format."""
    import torch

    from conveyor import kernels
    from conveyor.model import kv_quant
    from conveyor.model.attention import RowSpec, attend, build_metadata

    kernels.threads.set_num_threads(threads)
    heads, kv_heads, head_dim, layers = (int(x) for x in shape.split(","))
    block_size, per_row = 16, -(-context // 16)
    gen = torch.Generator().manual_seed(0)
    num_blocks = rows * per_row

    def int8_layer() -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(-127, 128, (2, num_blocks, kv_quant.block_bytes(block_size, kv_heads, head_dim)),
                               dtype=torch.int8, generator=gen)
        k, v = kv_quant.code_views(blocks, block_size, kv_heads, head_dim, True)
        kv_quant.scales_of(k, True).fill_(0.01)
        kv_quant.scales_of(v, False).fill_(0.01)
        return k, v

    caches = {"float16": [(torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=gen).half(),
                           torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).half())
                          for _ in range(layers)],
              "int8": [int8_layer() for _ in range(layers)]}
    order = torch.randperm(num_blocks, generator=gen).tolist()   # blocks scattered, as a busy cache has them
    specs = [RowSpec(i, 1, context, order[i * per_row:(i + 1) * per_row]) for i in range(rows)]
    tile = kernels.attention_tile_size(heads, kv_heads, head_dim, block_size)
    meta = build_metadata(specs, block_size, None, torch.device("cpu"), tile)
    q = torch.randn(rows, heads, head_dim, generator=gen)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(reps):
        for name, layer_caches in caches.items():
            start = time.perf_counter()
            for k, v in layer_caches:
                attend(q, k, v, meta, head_dim ** -0.5, None)
            times[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def gauges(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    wanted = ("conveyor:kv_cache_capacity_tokens", "conveyor:kv_cache_memory_bytes")
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.split("{")[0] in wanted}


def agreement(base: list[str], other: list[str]) -> dict:
    same = [a == b for a, b in zip(base, other)]
    return {"identical": sum(same), "of": len(same), "per_prompt": same}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench kv-int8", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a GGUF file (llama-server serves the same file)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--agree-tokens", type=int, default=16)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--context-tokens", type=int, default=2000)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--attention-shape", default="14,2,64,24", help="heads,kv heads,head dim,layers")
    parser.add_argument("--peers-dir", type=Path, default=Path("/work/peers/llama"))
    parser.add_argument("--no-peer", action="store_true", help="skip llama-server")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = parser.parse_args(argv)
    prompts = (PROMPTS * 2)[:args.num_prompts]
    results: dict[str, dict] = {}
    commands: dict[str, str] = {}
    kv_dtypes = ("float16", "int8")
    with tempfile.TemporaryDirectory(prefix="conveyor-kv8-") as scratch:
        with contextlib.ExitStack() as stack:
            urls = {}
            for kv in kv_dtypes:
                port = servers.free_port()
                cmd = servers.conveyor_command(port, model=args.model, threads=args.threads, dtype=None,
                                               quantization=None, max_num_seqs=args.streams,
                                               kv_cache_memory=args.kv_cache_memory, extra=["--kv-cache-dtype", kv])
                commands[f"conveyor {kv}"] = shlex.join(cmd)
                log = Path(scratch) / f"conveyor-{kv}.log"
                urls[kv] = stack.enter_context(servers.launched(cmd, port, log, startup_timeout_s=900)).base_url
            for kv in kv_dtypes:
                capacity = gauges(urls[kv])
                results[f"conveyor {kv}"] = {
                    "texts": chat_texts(urls[kv], prompts, args.agree_tokens), "capacity": capacity,
                    "tokens_per_gib": capacity["conveyor:kv_cache_capacity_tokens"] / (
                        capacity["conveyor:kv_cache_memory_bytes"] / 2**30),
                    "warm_up": decode_rate(urls[kv], args.streams, args.context_tokens, 2), "rounds": []}
            for _ in range(args.rounds):
                for kv in kv_dtypes:
                    results[f"conveyor {kv}"]["rounds"].append(
                        decode_rate(urls[kv], args.streams, args.context_tokens, args.output_tokens))
        for kv in kv_dtypes:
            result = results[f"conveyor {kv}"]
            # a round in which a stream sent no text in the window (special tokens only) has no figure
            result["decode_tok_s"] = statistics.median(r["tok_s"] for r in result["rounds"] if r["tok_s"])
            print(f"conveyor {kv}: {args.streams} streams at ~{args.context_tokens} tokens decode "
                  f"{result['decode_tok_s']:.1f} tok/s (median of {args.rounds}); {result['tokens_per_gib']:,.0f} "
                  f"tokens per GiB", flush=True)
        port = servers.free_port()
        llama = None if args.no_peer else servers.LlamaCpp.find(args.peers_dir)
        if llama is not None:
            for kv in ("f16", "q8_0"):
                cmd = llama.command(port, Path(args.model), parallel=1, ctx_per_slot=4096, threads=args.threads)
                cmd += ["-fa", "on", "-ctk", kv, "-ctv", kv]
                commands[f"llama-server {kv}"] = shlex.join(cmd)
                with servers.launched(cmd, port, Path(scratch) / f"llama-{kv}.log", startup_timeout_s=900) as server:
                    results[f"llama-server {kv}"] = {"texts": chat_texts(server.base_url, prompts, args.agree_tokens)}
    attention = attention_ms(args.attention_shape, args.streams, args.context_tokens, args.threads)
    print(f"attention alone, one decode step of {args.streams} rows at {args.context_tokens} tokens: float16 "
          f"{attention['float16']:.1f} ms, int8 {attention['int8']:.1f} ms", flush=True)
    figures = {"conveyor int8 vs float16": agreement(results["conveyor float16"]["texts"],
                                                     results["conveyor int8"]["texts"])}
    if "llama-server q8_0" in results:
        figures["llama-server q8_0 vs f16"] = agreement(results["llama-server f16"]["texts"],
                                                        results["llama-server q8_0"]["texts"])
    for name, fig in figures.items():
        print(f"{name}: greedy first {args.agree_tokens} tokens identical on {fig['identical']}/{fig['of']} prompts")
    f16, i8 = results["conveyor float16"], results["conveyor int8"]
    speedup = statistics.median(a["tok_s"] / b["tok_s"] for a, b in zip(i8["rounds"], f16["rounds"])
                                if a["tok_s"] and b["tok_s"])
    # ggml's f16 cache holds what conveyor's float16 one does (2 bytes a value); q8_0 keeps blocks of 32
    # values in 34 bytes (a float16 scale and 32 int8).
    llama_per_gib = {"f16": f16["tokens_per_gib"], "q8_0": f16["tokens_per_gib"] * 2 / (34 / 32)}
    print(f"decode int8 / float16: {speedup:.3f}x (median per-round ratio); tokens per GiB int8 "
          f"{i8['tokens_per_gib']:,.0f}, float16 {f16['tokens_per_gib']:,.0f} "
          f"({i8['tokens_per_gib'] / f16['tokens_per_gib']:.2f}x); llama.cpp q8_0 {llama_per_gib['q8_0']:,.0f}, "
          f"f16 {llama_per_gib['f16']:,.0f}")
    report.save_run("kv-int8", args.out_dir, {
        "servers": commands, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "prompts": prompts, "agreement": figures,
        "decode_speedup_int8_over_float16": speedup, "attention_ms": attention,
        "llama_cpp_tokens_per_gib": llama_per_gib, "results": results}, llama.commit() if llama else None)
