"""What serving costs over the engine: offline `LLM.generate` tok/s against `conveyor serve` tok/s.

    python -m bench served-overhead                      # a tiny random-weight model on the CPU
    python -m bench served-overhead --model bundled --device cuda --kv-cache-memory 8GiB   # on a GPU

The default model is a random-weight llama with 2 layers of hidden 64 and the bundled model's tokenizer
(49,152 tokens), written once to --model-dir: its steps are cheap, so what is left is the front
(tokenize, detokenize, stream), the pipe to the core and the core's own host work per step. For each
concurrency N: N requests of --prompt-tokens token ids and --tokens output tokens (ignore_eos, greedy),
offline in one `generate` call, then served by a real `conveyor serve` on a loopback port as N
concurrent streaming /v1/completions (plus, at N > 1, one non-streaming run). Prints tok/s both ways,
their ratio, ms per output token per request, and CPU microseconds per token: the offline process's and
the server's front and core processes' (on a machine whose cores the client and other work share, the
CPU figures say more than the rates). JSON to --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from bench import report
from bench.serving import servers

TINY_NAME = "tiny-llama-h64-smollm2-tokenizer.gguf"


def tiny_model(out_dir: Path) -> Path:
    """A 2-layer, hidden-64 llama GGUF (float32, seeded random weights) with the bundled tokenizer."""
    import gguf

    from bench.gguf_files import copy_tokenizer
    from conveyor.model.checkpoint import default_model_path

    path = out_dir / TINY_NAME
    if path.is_file():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    source = gguf.GGUFReader(default_model_path())
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    hidden, ffn, layers, heads, kv_heads = 64, 128, 2, 4, 2
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = copy_tokenizer(source, writer)   # the tokenizer and its chat template, as the bundled file has them
    kv = kv_heads * hidden // heads
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, np.float32) * 0.1).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    for i in range(layers):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(b + "attn_q.weight", weight(hidden, hidden))
        writer.add_tensor(b + "attn_k.weight", weight(kv, hidden))
        writer.add_tensor(b + "attn_v.weight", weight(kv, hidden))
        writer.add_tensor(b + "attn_output.weight", weight(hidden, hidden))
        writer.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(b + "ffn_gate.weight", weight(ffn, hidden))
        writer.add_tensor(b + "ffn_up.weight", weight(ffn, hidden))
        writer.add_tensor(b + "ffn_down.weight", weight(hidden, ffn))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)
    return path


def prompts(count: int, length: int, vocab_high: int) -> list[list[int]]:
    """Distinct token-id prompts (no shared prefix to cache), ids in [3, vocab_high): past the usual specials."""
    return [[3 + (i * 7919 + j * 31) % (vocab_high - 3) for j in range(length)] for i in range(count)]


def offline(model: str, device: str, threads: int, preset: str, sizes: list[int], prompt_tokens: int,
            tokens: int, vocab_high: int, kv_cache_memory: str | None) -> dict[int, dict]:
    from conveyor import LLM, SamplingParams

    kwargs = {"device": device, "max_num_seqs": max(sizes), "threads": threads, "batch_preset": preset}
    if kv_cache_memory:
        kwargs["kv_cache_memory"] = kv_cache_memory
    llm = LLM(model, **kwargs)
    out = {}
    for n in sizes:
        batch = prompts(n, prompt_tokens, vocab_high)
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        started, cpu_before = time.perf_counter(), time.process_time()
        outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                               use_tqdm=False)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_before
        produced = sum(len(o.token_ids) for o in outputs)
        out[n] = {"tok_s": produced / wall, "wall_s": wall, "ms_per_token": 1000 * wall / tokens,
                  "cpu_us_per_token": 1e6 * cpu / produced}
    del llm
    gc.collect()
    if device.startswith("cuda"):   # the server's core allocates its own cache next
        import torch

        torch.cuda.empty_cache()
    return out


async def _one(client: httpx.AsyncClient, prompt: list[int], tokens: int, stream: bool) -> int:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if not stream:
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True}
    produced = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    produced = usage["completion_tokens"]
    return produced


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def _served(base_url: str, batch: list[list[int]], tokens: int, stream: bool,
                  processes: dict[str, psutil.Process]) -> tuple[float, int, dict[str, float]]:
    """Wall seconds, tokens produced, and the CPU seconds each server process spent on them."""
    limits = httpx.Limits(max_connections=len(batch) + 4, max_keepalive_connections=len(batch) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0, limits=limits) as client:
        await asyncio.gather(*(_one(client, p, 4, stream) for p in batch))   # warm-up, and connections opened
        cpu_before = {name: _cpu_s(process) for name, process in processes.items()}
        started = time.perf_counter()
        produced = await asyncio.gather(*(_one(client, p, tokens, stream) for p in batch))
        wall = time.perf_counter() - started
        return wall, sum(produced), {name: _cpu_s(process) - cpu_before[name] for name, process in processes.items()}


def served(model: str, device: str, threads: int, preset: str, sizes: list[int], prompt_tokens: int, tokens: int,
           vocab_high: int, kv_cache_memory: str | None, log_dir: Path) -> dict[int, dict]:
    port = servers.free_port()
    extra = ["--device", device, "--batch-preset", preset]
    if kv_cache_memory:
        extra += ["--kv-cache-memory", kv_cache_memory]
    cmd = servers.conveyor_command(port, model=model, threads=threads, max_num_seqs=max(sizes),
                                   dtype=None, quantization=None, extra=extra)
    out: dict[int, dict] = {}
    with servers.launched(cmd, port, log_dir / "served_overhead-server.log") as server:
        front = psutil.Process(server.process.pid)
        cores = [c for c in front.children() if "spawn_main" in " ".join(c.cmdline())]
        processes = {"front": front, **({"core": cores[0]} if cores else {})}
        for n in sizes:
            batch = prompts(n, prompt_tokens, vocab_high)
            row = out[n] = {}
            for stream in (True, False) if n > 1 else (True,):
                wall, produced, cpu = asyncio.run(_served(server.base_url, batch, tokens, stream, processes))
                row["stream" if stream else "non_stream"] = {
                    "tok_s": produced / wall, "wall_s": wall, "ms_per_token": 1000 * wall / tokens,
                    "produced": produced, **{f"{name}_cpu_us_per_token": 1e6 * seconds / produced
                                             for name, seconds in cpu.items()}}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench served-overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="GGUF file or HF folder; 'bundled' for the bundled model (default: the tiny random-weight model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="the core's torch threads, offline and served")
    p.add_argument("--batch-preset", default="throughput", help="the same preset for both")
    p.add_argument("--concurrency", default="1,64", help="comma list of requests at once")
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--kv-cache-memory", default=None, help="passed to both (e.g. 8GiB on a GPU)")
    p.add_argument("--skip-offline", action="store_true", help="served only (profiling the server)")
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    p.add_argument("--log-dir", type=Path, default=Path("bench/results/served_overhead"), help="the server's log")
    p.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "conveyor-bench",
                   help="where the tiny model is written once")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.concurrency.split(",")]
    from conveyor.model.checkpoint import default_model_path, resolve_model_path
    from conveyor.text.tokenizer_loader import load_tokenizer

    model = (str(default_model_path()) if args.model == "bundled" else args.model) or str(tiny_model(args.model_dir))
    vocab_high = min(10_000, load_tokenizer(resolve_model_path(model)).vocab_size)
    common = (args.device, args.threads, args.batch_preset, sizes, args.prompt_tokens, args.tokens, vocab_high, args.kv_cache_memory)
    off = {} if args.skip_offline else offline(model, *common)
    srv = served(model, *common, args.log_dir)
    results = {}
    # CPU microseconds per token: the offline process's, and the server's front and core processes' while
    # streaming; on a shared or small machine these say more than the wall-clock rates.
    nan = float("nan")
    print(f"{'N':>4s} {'offline tok/s':>14s} {'served tok/s':>13s} {'ratio':>6s} {'non-stream':>11s} "
          f"{'ms/token off':>13s} {'ms/token srv':>13s} {'cpu us/tok off':>15s} {'front':>6s} {'core':>6s}")
    for n in sizes:
        o, s = off.get(n, {}), srv[n]
        stream, plain = s["stream"], s.get("non_stream", {})
        ratio = stream["tok_s"] / o["tok_s"] if o else nan
        print(f"{n:4d} {o.get('tok_s', nan):14.1f} {stream['tok_s']:13.1f} {ratio:6.2f} {plain.get('tok_s', nan):11.1f} "
              f"{o.get('ms_per_token', nan):13.2f} {stream['ms_per_token']:13.2f} "
              f"{o.get('cpu_us_per_token', nan):15.1f} {stream.get('front_cpu_us_per_token', nan):6.1f} "
              f"{stream.get('core_cpu_us_per_token', nan):6.1f}", flush=True)
        results[n] = {"offline": o or None, "served": s, "served_over_offline": ratio}
    report.save_run("served-overhead", args.out_dir, {"model": model, "device": args.device, "results": results})
