"""The prefix cache's host memory tier: TTFT of a long prompt cold, from the KV cache, and from host
memory after other prompts evicted its blocks from the KV cache, against recomputing it.

    python -m bench prefix-host --model /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --threads 2

`conveyor serve --prefix-cache-host-size SIZE --num-kv-blocks N` (N sized so that one prompt fits) gets one
--prompt-tokens prompt (seeded random token ids), streamed greedily for --output-tokens tokens: the cold
TTFT; the same request again hits the KV cache. Then another prompt of the same length takes the KV
cache's blocks, and the first prompt's TTFT is the host figure: its tokens must equal the cold run's.
Last, unless --no-baseline, a server without the host tier runs the same sequence: the first prompt after
the eviction is computed again. JSON goes to --out-dir with the command that reproduces it.
"""

from __future__ import annotations

import argparse
import random
import shlex
import tempfile
import time
from pathlib import Path

from bench import report
from bench.features.prefix_disk import metric_values, stream
from bench.serving import servers

METRICS = ("vllm:prefix_cache_hits_total", "conveyor:prefix_cache_host_hits_total",
           "conveyor:prefix_cache_host_read_bytes_total", "conveyor:prefix_cache_host_written_bytes_total",
           "conveyor:prefix_cache_host_bytes")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench prefix-host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or folder (default: the bundled model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--host-size", default="4GiB", help="--prefix-cache-host-size")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    parser.add_argument("--no-baseline", action="store_true", help="skip the server without the host tier")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompt, other = ([rng.randrange(100, 30000) for _ in range(args.prompt_tokens)] for _ in range(2))
    num_blocks = -(-(args.prompt_tokens + args.output_tokens) // args.block_size) + 2   # one prompt at a time
    base = ["--device", args.device, "--num-kv-blocks", str(num_blocks), "--block-size", str(args.block_size)]
    port = servers.free_port()
    commands = {"host": ["--prefix-cache-host-size", args.host_size], "baseline": []}
    runs: dict[str, dict] = {}
    metrics: dict[str, dict[str, float]] = {}
    served = (("cold", prompt), ("memory", prompt), ("evicting", other), ("after eviction", prompt))
    with tempfile.TemporaryDirectory(prefix="conveyor-host-") as scratch:
        for server_name, extra in commands.items():
            if server_name == "baseline" and args.no_baseline:
                continue
            cmd = servers.conveyor_command(port, model=args.model, threads=args.threads, dtype=None,
                                           quantization=None, extra=base + extra)
            with servers.launched(cmd, port, Path(scratch) / f"{server_name}.log") as server:
                for name, tokens in served:
                    ttft, pieces = stream(server.base_url, tokens, args.output_tokens)
                    runs[f"{server_name}: {name}"] = {"ttft_s": ttft, "pieces": pieces}
                    print(f"{server_name}: {name} TTFT {ttft:.3f} s", flush=True)
                metrics[server_name] = metric_values(server.base_url, METRICS)
                if server_name == "host":
                    command = shlex.join(cmd)
    same = all(run["pieces"] == runs["host: cold"]["pieces"] for name, run in runs.items() if "evicting" not in name)
    cold, host = runs["host: cold"]["ttft_s"], runs["host: after eviction"]["ttft_s"]
    print(f"{args.prompt_tokens}-token prompt, {num_blocks} KV blocks: cold TTFT {cold:.3f} s, from the KV cache "
          f"{runs['host: memory']['ttft_s']:.3f} s, from host memory after an eviction {host:.3f} s "
          f"({100 * host / cold:.1f} % of cold); greedy tokens identical: {same}")
    report.save_run("prefix-host", args.out_dir, {
        "server": command, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "num_kv_blocks": num_blocks,
        "ttft_s": {name: run["ttft_s"] for name, run in runs.items()}, "host_over_cold": host / cold,
        "identical_tokens": same, "metrics": metrics})
    if not same:
        raise SystemExit("the greedy tokens served from host memory differ from the cold run's")
