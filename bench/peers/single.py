"""Single-request decode, conveyor against llama-server --parallel 1, per weight format, in one run.

    python -m bench single                      # float32, bfloat16, int8, Q8_0, Q4_1
    python -m bench single --formats q4_1,q8_0 --requests 4 --output-tokens 128
    python -m bench single --model FILE.gguf    # any GGUF file: conveyor (its defaults) and llama-server on it

Every format decodes the same token-id prompts (the offline workload's first requests) with the same
threads. conveyor: tokens after the first / time after the first (request metrics). llama-server:
1000 / mean TPOT from the streaming client. Peers run one at a time, never beside conveyor. Needs
scripts/build_llama_cpp.sh (the F32 and Q8_0 files live in its directory; Q4_1 is the bundled file).
With --model the formats give way to one row, "model": that file, run by conveyor with its default
dtype and quantization (or --conveyor-dtype/--conveyor-quantization) and served by llama-server as is.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

from bench import report
from bench.peers.conveyor_offline import single_stream_decode
from bench.serving import servers
from bench.serving.client import run_serving
from bench.serving.metrics import summarize
from bench.workloads import offline_workload

# format -> (conveyor options, the GGUF file llama-server runs: "f32", "q8_0" or "q4_1")
FORMATS = {
    "float32": ({"dtype": "float32"}, "f32"),
    "bfloat16": ({"dtype": "bfloat16"}, "f32"),
    "int8": ({"dtype": "float32", "quantization": "int8"}, "q8_0"),
    "q8_0": ({"dtype": "float32", "quantization": "gguf", "model": "q8_0"}, "q8_0"),
    "q4_1": ({"dtype": "float32", "quantization": "gguf", "model": "q4_1"}, "q4_1"),
}


def gguf_paths(peers_dir: Path, model: str | None = None) -> dict[str, Path]:
    from conveyor.model.checkpoint import resolve_model_path

    files = {"f32": peers_dir / servers.F32_GGUF_NAME, "q8_0": peers_dir / servers.Q8_0_GGUF_NAME,
             "q4_1": resolve_model_path(None)}
    return {**files, "model": Path(model)} if model else files


def conveyor_rate(options: dict, files: dict[str, Path], threads: int, requests) -> float:
    from conveyor import LLM

    options = dict(options)
    model = options.pop("model", None)
    llm = LLM(str(files[model]) if model else None, threads=threads, max_num_seqs=1, kv_cache_memory="256MiB",
              **options)
    single_stream_decode(llm, requests[:1])   # warm-up
    rate = single_stream_decode(llm, requests)["decode_tokens_per_s"]
    del llm
    gc.collect()
    return rate


def llama_rate(llama: servers.LlamaCpp, gguf: Path, threads: int, requests, log: Path) -> float:
    port = servers.free_port()
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests) + 16
    cmd = llama.command(port, gguf, parallel=1, ctx_per_slot=longest, threads=threads)
    with servers.launched(cmd, port, log) as server:
        run_serving(server.base_url, requests[:1], model=None, rate=None, max_concurrency=1, seed=0)
        fig = summarize(run_serving(server.base_url, requests, model=None, rate=None, max_concurrency=1, seed=0),
                        2.0, 0.25)
    return 1000 / fig["tpot_ms"]["mean"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench single", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--model", default=None, help="a GGUF file for both systems instead of the bundled model's formats")
    p.add_argument("--conveyor-dtype", default=None, help="with --model: conveyor's --dtype (default: its own)")
    p.add_argument("--conveyor-quantization", default=None,
                   help="with --model: conveyor's --quantization, passed through (default: its own)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peers-dir", type=Path, default=servers.DEFAULT_PEERS_DIR)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    p.add_argument("--log-dir", type=Path, default=Path("bench/results/single"), help="llama-server's logs")
    args = p.parse_args(argv)
    requests = offline_workload(args.requests, 100, 500, args.output_tokens, seed=0)
    files = gguf_paths(args.peers_dir, args.model)
    formats = dict(FORMATS)
    if args.model:
        options = {"dtype": args.conveyor_dtype, "quantization": args.conveyor_quantization, "model": "model"}
        formats = {"model": ({k: v for k, v in options.items() if v is not None}, "model")}
    llama = servers.LlamaCpp.find(args.peers_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    peer_rates: dict[str, float] = {}
    rows = {}
    for name in formats if args.model else args.formats.split(","):
        options, peer = formats[name]
        ours = conveyor_rate(options, files, args.threads, requests)
        if peer not in peer_rates and llama is not None and files[peer].is_file():
            peer_rates[peer] = llama_rate(llama, files[peer], args.threads, requests,
                                          args.log_dir / f"single-{stamp}-llama-{peer}.log")
        theirs = peer_rates.get(peer)
        rows[name] = {"conveyor_tok_s": ours, "llama_server_file": peer, "llama_server_tok_s": theirs,
                      "ratio": ours / theirs if theirs else None}
        print(f"{name:9s} conveyor {ours:6.1f} tok/s   llama-server -np 1 ({peer}) "
              + (f"{theirs:6.1f} tok/s   {ours / theirs:.2f}x" if theirs else "not run"), flush=True)
    report.save_run("single", args.out_dir, {"model": args.model, "threads": args.threads, "requests": args.requests,
                                             "output_tokens": args.output_tokens, "results": rows},
                    llama.commit() if llama else None)
