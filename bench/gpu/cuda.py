"""On a CUDA GPU: conveyor offline, conveyor served, and transformers' `generate_batch`, same weights.

    python -m bench cuda --model FILE.gguf|DIR [--rows 1,64,256] [--tokens 128] [--prompt-tokens 128]
    python -m bench cuda --shape qwen2.5-0.5b --tokenizer DIR    # random weights of that shape (seeded)

Per number of requests at once (all sent together, `ignore_eos`, greedy, random token-id prompts):
- offline: `LLM.generate` (conveyor's defaults for the device), tok/s and ms per step;
- served: `conveyor serve` on a loopback port, streamed completions: tok/s, TTFT and TPOT (p50);
- transformers: `generate_batch` (its continuous batching) on the same weights in bfloat16.
One request's decode alone is timed as the difference of two lengths (so the prompt drops out) and set
against its floor: the bytes a decode step reads (every weight once) over the card's copy bandwidth,
measured in the same run. JSON to --out-dir.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from pathlib import Path

from bench import report
from bench.serving.client import run_serving
from bench.serving.metrics import percentile
from bench.serving.servers import conveyor_command, free_port, launched
from bench.workloads import OfflineRequest, fixed_workload

SHAPES = {   # published configs; weights random (seeded): speed and memory are real, tokens mean nothing
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def make_shaped(shape: str, tokenizer: Path, out: Path, seed: int = 0) -> Path:
    """A Hugging Face folder of `shape` with seeded random bfloat16 weights and `tokenizer`'s files."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**SHAPES[shape], torch_dtype="bfloat16")
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer.iterdir():
        if f.is_file() and not f.name.startswith("config"):
            shutil.copy(f, out / f.name)
    del model
    return out


def copy_bandwidth(device: str, size: int = 2 * 2**30, repeats: int = 10) -> float:
    """Bytes per second a device-to-device copy moves, counting what it reads and what it writes."""
    import torch

    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    return 2 * size * repeats / (time.perf_counter() - started)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def offline(model: str, device: str, rows: list[int], prompt_tokens: int, tokens: int, vocab_high: int,
            kv_memory: str, engine: dict) -> dict:
    import torch

    from conveyor import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model, device=device, kv_cache_memory=kv_memory, max_num_seqs=max(rows), **engine)
    out: dict = {"start_s": time.perf_counter() - started, "by_rows": {}}
    runner = llm.engine.runner
    out["weight_bytes"] = sum(t.numel() * t.element_size()
                              for t in [*runner.model.parameters(), *runner.model.buffers()])

    def timed(reqs: list[OfflineRequest], max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        sync(device)
        t0 = time.perf_counter()
        llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
        sync(device)
        return time.perf_counter() - t0

    for n in rows:
        timed(fixed_workload(n, prompt_tokens, tokens, vocab_high, salt=1), 8)   # captures the graphs it needs
        wall = timed(fixed_workload(n, prompt_tokens, tokens, vocab_high), tokens)
        out["by_rows"][n] = {"tok_s": n * tokens / wall, "ms_per_step": 1000 * wall / tokens}
        print(f"offline     {n:4d} at once: {n * tokens / wall:10.1f} tok/s, {1000 * wall / tokens:7.2f} ms per step",
              flush=True)
    one = fixed_workload(1, prompt_tokens, tokens, vocab_high, salt=2)
    short, long_ = timed(one, 16), timed(one, 16 + 4 * tokens)
    out["decode_ms_per_token_1row"] = 1000 * (long_ - short) / (4 * tokens)
    graphs = runner.graphs
    out["graphs"] = None if graphs is None else {"captured": len(graphs.graphs), "failed": graphs.failed}
    out["dtype"] = str(llm.engine.core.dtype).removeprefix("torch.")
    del llm, runner
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def served(model: str, device: str, rows: list[int], prompt_tokens: int, tokens: int, vocab_high: int,
           kv_memory: str, engine: dict, log_dir: Path) -> dict:
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()]
    cmd = conveyor_command(port, model=model, threads=4, dtype=None, quantization=None, kv_cache_memory=kv_memory,
                           max_num_seqs=max(rows), extra=["--device", device, *flags])
    out: dict = {"command": " ".join(cmd[2:]), "by_rows": {}}
    with launched(cmd, port, log_dir / f"conveyor-serve-{port}.log", startup_timeout_s=600) as server:
        out["start_s"] = server.startup_s
        for n in rows:
            run_serving(server.base_url, fixed_workload(n, prompt_tokens, 8, vocab_high, salt=1))   # graphs, warm
            run = run_serving(server.base_url, fixed_workload(n, prompt_tokens, tokens, vocab_high))
            done = [r for r in run.records if r.error is None]
            produced = sum(r.output_tokens for r in done)
            tpots = [r.tpot_s for r in done if r.tpot_s is not None]
            ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
            fig = {"tok_s": produced / run.duration_s, "failed": len(run.records) - len(done),
                   "ttft_p50_ms": 1000 * percentile(ttfts, 50) if ttfts else None,
                   "tpot_p50_ms": 1000 * percentile(tpots, 50) if tpots else None,
                   "errors": sorted({r.error[:200] for r in run.records if r.error})[:3]}
            out["by_rows"][n] = fig
            print(f"served      {n:4d} at once: {fig['tok_s']:10.1f} tok/s, TTFT p50 {fig['ttft_p50_ms'] or 0:8.1f} ms, "
                  f"TPOT p50 {fig['tpot_p50_ms'] or 0:6.2f} ms, failed {fig['failed']}", flush=True)
    return out


def transformers_batch(model: str, device: str, rows: list[int], prompt_tokens: int, tokens: int,
                       vocab_high: int) -> dict:
    import logging

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    logging.getLogger("transformers.generation.continuous_batching").setLevel(logging.ERROR)
    path = Path(model)
    kwargs = {"gguf_file": path.name} if path.is_file() else {}
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent if path.is_file() else path), dtype=torch.bfloat16,
                                              **kwargs).to(device).eval()
    out: dict = {"by_rows": {}}

    def timed(reqs: list[OfflineRequest], new: int) -> float:
        gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
        sync(device)
        t0 = time.perf_counter()
        results = hf.generate_batch([r.prompt_token_ids for r in reqs], generation_config=gen, progress_bar=False)
        sync(device)
        wall = time.perf_counter() - t0
        failed = [o for o in results.values() if getattr(o, "error", None)]
        if failed or len(results) != len(reqs):
            raise RuntimeError(f"{len(reqs) - len(results) + len(failed)} of {len(reqs)} requests failed")
        return wall

    for n in rows:
        timed(fixed_workload(n, prompt_tokens, tokens, vocab_high, salt=1), 8)
        wall = timed(fixed_workload(n, prompt_tokens, tokens, vocab_high), tokens)
        out["by_rows"][n] = {"tok_s": n * tokens / wall}
        print(f"transformers {n:3d} at once: {n * tokens / wall:10.1f} tok/s", flush=True)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _guarded(name: str, fn, *args) -> dict:  # noqa: ANN001 - one of the measures above
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - one system failing must not lose the others' figures
        print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
        return {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench cuda", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file or Hugging Face folder (default: the bundled model)")
    p.add_argument("--shape", choices=tuple(SHAPES), default=None, help="random weights of this shape instead")
    p.add_argument("--tokenizer", type=Path, default=None, help="--shape: a folder with the tokenizer's files")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default="1,64,256", help="comma list of requests at once")
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--kv-cache-memory", default="16GiB", help="the same KV cache for offline and served")
    p.add_argument("--systems", default="offline,served,transformers")
    p.add_argument("--quantization", default=None, help="conveyor's --quantization (default: its own)")
    p.add_argument("--attention-backend", default=None, help="conveyor's --attention-backend (default: its own)")
    p.add_argument("--label", default="", help="a name for the JSON file (e.g. bundled, 0.5b)")
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = p.parse_args(argv)
    from bench.kernels.limits import model_arch

    rows = [int(n) for n in args.rows.split(",")]
    systems = args.systems.split(",")
    work = Path(tempfile.mkdtemp(prefix="bench-cuda-"))
    model = args.model
    if args.shape is not None:
        if args.tokenizer is None:
            p.error("--shape needs --tokenizer")
        model = str(make_shaped(args.shape, args.tokenizer, work / args.shape))
    if model is None:
        from conveyor.model.checkpoint import resolve_model_path

        model = str(resolve_model_path(None))
    vocab_high = min(32_000, model_arch(model).vocab_size)
    bandwidth = copy_bandwidth(args.device)
    print(f"copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    shape = (args.device, rows, args.prompt_tokens, args.tokens, vocab_high)
    engine = {k: v for k, v in (("quantization", args.quantization), ("attention_backend", args.attention_backend))
              if v is not None}
    results = {}
    if "offline" in systems:
        results["offline"] = _guarded("offline", offline, model, *shape, args.kv_cache_memory, engine)
    if "served" in systems:
        results["served"] = _guarded("served", served, model, *shape, args.kv_cache_memory, engine, work)
    if "transformers" in systems:
        results["transformers"] = _guarded("transformers", transformers_batch, model, *shape)
    summary: dict = {"copy_bandwidth_bytes_s": bandwidth}
    off = results.get("offline", {})
    if "decode_ms_per_token_1row" in off:
        floor_ms = 1000 * off["weight_bytes"] / bandwidth
        summary["decode_1row"] = {"ms_per_token": off["decode_ms_per_token_1row"], "floor_ms": floor_ms,
                                  "over_floor": off["decode_ms_per_token_1row"] / floor_ms}
        print(f"one row decodes at {off['decode_ms_per_token_1row']:.2f} ms per token; weights "
              f"{off['weight_bytes'] / 1e9:.2f} GB over the copy bandwidth: {floor_ms:.3f} ms "
              f"({off['decode_ms_per_token_1row'] / floor_ms:.1f}x the floor)", flush=True)
    for n in rows:
        figs = {name: r.get("by_rows", {}).get(n, {}).get("tok_s") for name, r in results.items()}
        line = {"tok_s": figs}
        if figs.get("served") and figs.get("offline"):
            line["served_over_offline"] = figs["served"] / figs["offline"]
        if figs.get("transformers") and figs.get("offline"):
            line["offline_over_transformers"] = figs["offline"] / figs["transformers"]
        summary[n] = line
        print(f"{n:4d} at once: " + ", ".join(f"{k} {v:.2f}x" for k, v in line.items() if k != "tok_s"), flush=True)
    name = "cuda" + (f"-{args.label}" if args.label else "")
    report.save_run(name, args.out_dir, {"model": args.shape or model, "engine": engine, "rows": rows,
                                         "tokens": args.tokens,
                                         "prompt_tokens": args.prompt_tokens, "summary": summary,
                                         "results": results})
    shutil.rmtree(work, ignore_errors=True)
