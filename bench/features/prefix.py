"""Prefix caching: TTFT of a late conversation turn and shared-system-prompt throughput, on vs off.

    python -m bench prefix --turns 10 --num-requests 64 --system-tokens 400
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from bench import report
from conveyor import LLM, SamplingParams


def conversation_ttft(llm: LLM, turns: int, answer_tokens: int) -> float:
    """Play a conversation turn by turn; return the TTFT of the last turn."""
    rng = random.Random(1)
    topics = ["trains", "tea", "rivers", "clocks", "bridges", "maps", "owls", "kites", "ships", "bells", "lamps"]
    messages = [{"role": "system", "content": "You are a helpful assistant. Keep answers short."}]
    params = SamplingParams(temperature=0, max_tokens=answer_tokens, ignore_eos=True)
    ttft = 0.0
    for _ in range(turns):
        messages.append({"role": "user", "content": f"Tell me one fact about {rng.choice(topics)}."})
        out = llm.chat([messages], params, use_tqdm=False)[0]
        ttft = out.metrics.ttft_s
        messages.append({"role": "assistant", "content": out.text})
    return ttft


def shared_prompt_throughput(llm: LLM, num_requests: int, system_tokens: int, output_tokens: int) -> float:
    rng = random.Random(2)
    system = [rng.randrange(100, 40000) for _ in range(system_tokens)]
    prompts = [system + [rng.randrange(100, 40000) for _ in range(rng.randint(10, 60))] for _ in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench prefix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = parser.parse_args(argv)
    figures: dict = {}
    for caching in (True, False):
        llm = LLM(threads=args.threads, enable_prefix_caching=caching, max_num_seqs=64,
                  max_num_batched_tokens=512, kv_cache_memory="4GiB")
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        key = "on" if caching else "off"
        figures[f"ttft_turn{args.turns}_s/{key}"] = conversation_ttft(llm, args.turns, args.answer_tokens)
        figures[f"shared_prompt_output_tok_s/{key}"] = shared_prompt_throughput(
            llm, args.num_requests, args.system_tokens, args.output_tokens)
        figures[f"prefix_hit_rate/{key}"] = llm.engine.stats.prefix_hit_rate
        print({k: round(v, 3) for k, v in figures.items() if k.endswith(key)}, flush=True)
        del llm
    ttft_ratio = figures[f"ttft_turn{args.turns}_s/off"] / figures[f"ttft_turn{args.turns}_s/on"]
    tput_ratio = figures["shared_prompt_output_tok_s/on"] / figures["shared_prompt_output_tok_s/off"]
    print(f"turn {args.turns} TTFT: {figures[f'ttft_turn{args.turns}_s/on']:.3f} s with caching vs "
          f"{figures[f'ttft_turn{args.turns}_s/off']:.3f} s without ({ttft_ratio:.2f}x faster)")
    print(f"{args.num_requests} requests sharing a {args.system_tokens}-token system prompt: "
          f"{figures['shared_prompt_output_tok_s/on']:.1f} vs {figures['shared_prompt_output_tok_s/off']:.1f} "
          f"output tok/s ({tput_ratio:.2f}x)")
    report.save_run("prefix", args.out_dir, {"options": {k: v for k, v in vars(args).items() if k != "out_dir"},
                                             "figures": figures})
