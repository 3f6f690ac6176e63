"""The prefix cache's disk tier: TTFT of a long prompt cold, again from memory, and after a server restart.

    python -m bench prefix-disk --model /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --threads 2

`conveyor serve --prefix-cache-dir DIR` (a fresh DIR) gets one --prompt-tokens prompt (seeded random
token ids), streamed greedily for --output-tokens tokens: the cold TTFT. The same request again is
served from the memory prefix cache. The server is stopped (SIGTERM) and started again on the same
DIR; the same request's TTFT is then the restart figure, and its tokens must equal the cold run's.
Last, unless --no-baseline, a server without --prefix-cache-dir runs it cold: what writing every
block to disk costs the cold run. JSON goes to --out-dir with the command that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import tempfile
import time
from pathlib import Path

import httpx

from bench import report
from bench.serving import servers


def stream(base_url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[str]]:
    """(TTFT in seconds, the streamed text pieces) of one greedy streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    pieces: list[str] = []
    ttft = None
    start = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("text") is not None:
                if ttft is None:
                    ttft = time.perf_counter() - start
                pieces.append(choices[0]["text"])
    if ttft is None:
        raise RuntimeError("no token streamed")
    return ttft, pieces


DISK_METRICS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total",
                "vllm:external_prefix_cache_hits_total", "conveyor:prefix_cache_disk_read_bytes_total",
                "conveyor:prefix_cache_disk_written_bytes_total")


def metric_values(base_url: str, wanted: tuple[str, ...] = DISK_METRICS) -> dict[str, float]:
    """The server's /metrics samples named in `wanted` (labels dropped)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.split("{")[0] in wanted}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench prefix-disk", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or folder (default: the bundled model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: a fresh temporary folder")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    parser.add_argument("--no-baseline", action="store_true", help="skip the cold run without the disk tier")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 30000) for _ in range(args.prompt_tokens)]
    with tempfile.TemporaryDirectory(prefix="conveyor-kv-") as scratch:
        cache_dir = args.cache_dir or Path(scratch) / "kv"
        port = servers.free_port()
        cmd = servers.conveyor_command(port, model=args.model, threads=args.threads, dtype=None, quantization=None,
                                       extra=["--prefix-cache-dir", str(cache_dir)])
        runs: dict[str, dict] = {}
        for phase in ("first start", "restart"):
            log = Path(scratch) / f"{phase.replace(' ', '-')}.log"
            with servers.launched(cmd, port, log) as server:
                names = ("cold", "memory") if phase == "first start" else ("disk", "memory again")
                for name in names:
                    ttft, pieces = stream(server.base_url, prompt, args.output_tokens)
                    runs[name] = {"ttft_s": ttft, "pieces": pieces}
                    print(f"{phase}: {name} TTFT {ttft:.3f} s", flush=True)
                runs[names[0]]["startup_s"] = server.startup_s
                runs[names[0]]["metrics"] = metric_values(server.base_url)
        files = list(cache_dir.glob("*/*.kv"))
        disk_bytes = sum(p.stat().st_size for p in files)
        if not args.no_baseline:
            plain = servers.conveyor_command(port, model=args.model, threads=args.threads, dtype=None,
                                             quantization=None)
            with servers.launched(plain, port, Path(scratch) / "baseline.log") as server:
                ttft, pieces = stream(server.base_url, prompt, args.output_tokens)
                runs["cold without the disk tier"] = {"ttft_s": ttft, "pieces": pieces}
                print(f"without --prefix-cache-dir: cold TTFT {ttft:.3f} s", flush=True)
    same = all(runs[name]["pieces"] == runs["cold"]["pieces"] for name in runs)
    ratio = runs["disk"]["ttft_s"] / runs["cold"]["ttft_s"]
    print(f"{args.prompt_tokens}-token prompt: cold TTFT {runs['cold']['ttft_s']:.2f} s, from memory "
          f"{runs['memory']['ttft_s']:.3f} s, after a restart from disk {runs['disk']['ttft_s']:.3f} s "
          f"({100 * ratio:.1f} % of cold); greedy tokens identical: {same}; {len(files)} block files, "
          f"{disk_bytes / 2**20:.1f} MiB")
    report.save_run("prefix-disk", args.out_dir, {
                "server": shlex.join(cmd), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                "ttft_s": {name: run["ttft_s"] for name, run in runs.items()}, "restart_over_cold": ratio,
                "identical_tokens": same, "num_block_files": len(files), "disk_bytes": disk_bytes,
                "metrics": {name: run["metrics"] for name, run in runs.items() if "metrics" in run},
                "startup_s": {name: run["startup_s"] for name, run in runs.items() if "startup_s" in run}})
    if not same:
        raise SystemExit("the restarted server's greedy tokens differ from the cold run's")
