"""One-stream decode of conveyor serve and one peer, both resident, in alternating rounds.

    python -m bench paired-decode --model FILE.gguf [--peer ik-llama-rtr] [--rounds 8] [--tokens 64]

bench.peers.real_models runs each system in its own minutes; on a shared host the memory bandwidth a
one-row decode step streams at swings by a third within minutes, which is larger than the gap being
measured. Here both servers stay up (their weights resident, so memory must hold both) and take turns:
each round sends one request of `--tokens` output tokens to each (the order flips every round), and
the figure is conveyor's tok/s over the peer's in the same round; the median of the rounds is reported.
The wall, the C stream read of 2 GiB on the same threads, is measured before every round and after the
last: each system's share of it in a round is bytes read per token times its tok/s over the mean of the
two reads around that round (the host's bandwidth moves within minutes, so walls read only at the ends of
a run say little about its middle), and the median of those shares is reported. JSON goes to --out-dir
(docs/bench).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from pathlib import Path

from bench import report
from bench.kernels.limits import StreamProbe, model_arch
from bench.peers.real_models import conveyor_server, decode_bytes_per_token, find_peers, llama_server, served
from bench.serving import servers
from bench.serving.metrics import summarize
from bench.workloads import offline_workload, warmup_workload

PEERS = ("ik-llama-rtr", "ik-llama", "llama-server")


def one_stream_tok_s(base_url: str, tokens: int, vocab_high: int, seed: int,
                     prompt: tuple[int, int] = (100, 300)) -> float:
    """One request, a prompt of prompt[0] to prompt[1] tokens, `tokens` out (ignore_eos): 1000 / TPOT."""
    request = offline_workload(1, *prompt, tokens, vocab_low=100, vocab_high=vocab_high, seed=seed)
    return 1000 / summarize(served(base_url, request, max_concurrency=1))["tpot_ms"]["mean"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench paired-decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a GGUF file")
    p.add_argument("--peer", default=PEERS[0], choices=PEERS)
    p.add_argument("--threads", type=int, default=2, help="CPU threads of each system")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64, help="output tokens of each request")
    p.add_argument("--prompt-tokens", default="100-300", help="each prompt's length, drawn from LOW-HIGH (decode "
                   "attends to it: a long one measures decode at long context)")
    p.add_argument("--conveyor-quantization", default=None, help="conveyor's --quantization (default: its own)")
    p.add_argument("--conveyor-kv-cache-memory", default="1GiB", help="conveyor's --kv-cache-memory")
    p.add_argument("--conveyor-device", default="cpu")
    p.add_argument("--peers-dir", type=Path, default=servers.DEFAULT_PEERS_DIR)
    p.add_argument("--ik-dir", type=Path, default=None, help="ik_llama.cpp's tree (default: <peers-dir>/ik)")
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    p.add_argument("--log-dir", type=Path, default=Path("bench/results/paired_decode"))
    args = p.parse_args(argv)
    peer = find_peers(args)[args.peer]
    if isinstance(peer, str):
        raise SystemExit(peer)
    arch = model_arch(str(args.model))
    vocab_high = min(40_000, arch.vocab_size)
    low, _, high = args.prompt_tokens.partition("-")
    prompt = (int(low), int(high or low))
    ctx = prompt[1] + args.tokens + 16
    systems = {"conveyor": conveyor_server(args.model, args),
               args.peer: llama_server(peer, args.model, args.threads, arch, args.log_dir)}
    print(f"CPU: {report.machine()['lscpu']}; threads {args.threads}; {args.model.name}", flush=True)
    probe = StreamProbe(args.threads)
    walls = []   # before each round, and after the last
    figures: dict[str, list[float]] = {name: [] for name in systems}
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, server in systems.items():   # one start at a time: load times stay apart
            port = servers.free_port()
            launched = stack.enter_context(servers.launched(
                server.command(port, 1, ctx), port, args.log_dir / f"{args.model.stem}-{name}.log",
                startup_timeout_s=900, poll_s=0.05))
            urls[name] = launched.base_url
            served(launched.base_url, warmup_workload(vocab_high=vocab_high))
        for r in range(args.rounds):
            walls.append(probe(repeats=2))
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for name in order:
                figures[name].append(one_stream_tok_s(urls[name], args.tokens, vocab_high, seed=r, prompt=prompt))
            ratio = figures["conveyor"][-1] / figures[args.peer][-1]
            print(f"round {r}: conveyor {figures['conveyor'][-1]:.2f} tok/s, {args.peer} "
                  f"{figures[args.peer][-1]:.2f}, ratio {ratio:.2f}", flush=True)
        walls.append(probe(repeats=2))
    ratios = [a / b for a, b in zip(figures["conveyor"], figures[args.peer])]
    per_token = decode_bytes_per_token(args.model)
    round_walls = [(a + b) / 2 for a, b in zip(walls, walls[1:])]
    summary = {name: {"tok_s": values, "median_tok_s": statistics.median(values),
                      "shares_of_stream": [per_token * v / w for v, w in zip(values, round_walls)],
                      "median_share_of_stream": statistics.median(per_token * v / w
                                                                   for v, w in zip(values, round_walls))}
               for name, values in figures.items()}
    print(f"median ratio conveyor / {args.peer}: {statistics.median(ratios):.3f} over {args.rounds} rounds "
          f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}, {statistics.quantiles(ratios, n=4)[2]:.3f}); "
          f"stream {min(walls) / 1e9:.1f} to {max(walls) / 1e9:.1f} GB/s over the run; median share of the "
          "stream read around each round: " + ", ".join(f"{n} {s['median_share_of_stream']:.0%}"
                                                        for n, s in summary.items()), flush=True)
    out = report.save_run("paired-decode", args.out_dir, {
        "model": str(args.model), "file_bytes": args.model.stat().st_size, "peer": args.peer,
        "peer_commit": peer.commit(), "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
        "prompt_tokens": list(prompt),
        "ratios": ratios, "median_ratio": statistics.median(ratios), "systems": summary,
        "stream_read_bytes_per_s": walls, "decode_bytes_per_token": per_token,
        "commands": {name: " ".join(s.command(0, 1, ctx)) for name, s in systems.items()}}, None)
    print(f"JSON: {out}")
