"""Decode through the one-call C decoder layer against the same layers op by op, in one process.

    python scripts/fused_layer_speed.py [--dtype bfloat16|float32] [--layers 4]

A random-weight checkpoint shaped like Phi-4-mini's layers (hidden 3072, 24 heads over 8 KV heads of
128, RoPE on the leading 96 values of each head, MLP 8192; a small vocabulary) is written to a temp
folder with transformers (the tests' tiny tokenizer beside it). One request of 100 prompt tokens and
48 output tokens, alternating the two paths; prints the median of each and whether the tokens agree
(float32: they must; bfloat16 rounds the two paths' RoPE differently).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import _build_tokenizer_files  # noqa: E402

from conveyor import LLM, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp())
    config = transformers.Phi3Config(hidden_size=3072, intermediate_size=8192, num_hidden_layers=args.layers,
                                     num_attention_heads=24, num_key_value_heads=8, vocab_size=2048,
                                     max_position_embeddings=4096, partial_rotary_factor=0.75,
                                     tie_word_embeddings=True, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    transformers.Phi3ForCausalLM(config).to(getattr(torch, args.dtype)).save_pretrained(folder)
    _build_tokenizer_files(folder)
    llm = LLM(str(folder), dtype=args.dtype, kv_cache_memory="256MiB", threads=2)
    model = llm.engine.core.model
    if not model.fused_layers:
        raise SystemExit("the one-call layer does not run this model here (no C kernels?)")
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompt = [[5 + i % 900 for i in range(100)]]
    llm.generate(prompt, params)   # warm-up
    seconds: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[int]] = {}
    for _ in range(args.rounds):
        for fused in (True, False):
            model.fused_layers = fused
            started = time.perf_counter()
            tokens[fused] = llm.generate(prompt, params)[0].token_ids
            seconds[fused].append(time.perf_counter() - started)
    one_call, op_by_op = (statistics.median(seconds[f]) * 1000 / 48 for f in (True, False))
    print(f"{args.dtype}, {args.layers} layers: one call {one_call:.2f} ms per token, op by op {op_by_op:.2f} "
          f"({op_by_op / one_call:.2f}x); same tokens: {tokens[True] == tokens[False]}")


if __name__ == "__main__":
    main()
