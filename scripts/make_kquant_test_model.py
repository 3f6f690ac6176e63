"""Write a small llama-shaped GGUF file in the K-quant mix users download (Q4_K_M), for the GPU's
kept-quantized tests: rows a multiple of 256 (hidden 256, FFN 768, 4 layers, 4 heads over 2 KV heads),
seeded random float16 weights, the bundled SmolLM2 file's tokenizer and chat template (49,152 tokens,
tied embeddings), then llama.cpp's `llama-quantize ... Q4_K_M` with the token table in Q4_K (its
default Q6_K table alone would be 10 MB). Its tokens mean nothing; its greedy output is still a
deterministic function of the weights, which is what the parity test compares.

    python scripts/make_kquant_test_model.py [--out /work/models/kquant-test-q4_k_m.gguf]
        [--quantize /work/peers/llama/llama.cpp/build/bin/llama-quantize]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repo: bench's GGUF helpers

from bench.gguf_files import copy_tokenizer  # noqa: E402
from conveyor.model.checkpoint import default_model_path  # noqa: E402

SHAPE = dict(layers=4, hidden=256, ffn=768, heads=4, kv_heads=2, ctx=2048, theta=10000.0)


def write_f16(path: Path, like: Path) -> None:
    s = SHAPE
    src = gguf.GGUFReader(like)
    out = gguf.GGUFWriter(str(path), "llama")
    out.add_name("kquant test model, random weights")
    out.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    out.add_block_count(s["layers"])
    out.add_context_length(s["ctx"])
    out.add_embedding_length(s["hidden"])
    out.add_feed_forward_length(s["ffn"])
    out.add_head_count(s["heads"])
    out.add_head_count_kv(s["kv_heads"])
    out.add_rope_freq_base(s["theta"])
    out.add_layer_norm_rms_eps(1e-5)
    vocab = copy_tokenizer(src, out)
    out.add_vocab_size(vocab)
    hidden, ffn = s["hidden"], s["ffn"]
    kv = s["kv_heads"] * hidden // s["heads"]
    rng = np.random.default_rng(0)
    # Wider than an initialisation's 0.02, so the logits are peaked enough that greedy choices are rarely
    # near-ties between two tokens (the parity test compares greedy tokens across paths).
    out.add_tensor("token_embd.weight", (rng.standard_normal((vocab, hidden)) * 0.1).astype(np.float16))
    for i in range(s["layers"]):
        def add(name: str, rows: int, cols: int, std: float = 0.08) -> None:
            out.add_tensor(f"blk.{i}.{name}.weight", (rng.standard_normal((rows, cols)) * std).astype(np.float16))

        out.add_tensor(f"blk.{i}.attn_norm.weight", rng.uniform(0.8, 1.2, hidden).astype(np.float32))
        add("attn_q", hidden, hidden)
        add("attn_k", kv, hidden)
        add("attn_v", kv, hidden)
        add("attn_output", hidden, hidden)
        out.add_tensor(f"blk.{i}.ffn_norm.weight", rng.uniform(0.8, 1.2, hidden).astype(np.float32))
        add("ffn_gate", ffn, hidden)
        add("ffn_up", ffn, hidden)
        add("ffn_down", hidden, ffn, 0.05)
    out.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/work/models/kquant-test-q4_k_m.gguf"))
    p.add_argument("--quantize", default="/work/peers/llama/llama.cpp/build/bin/llama-quantize")
    p.add_argument("--like", type=Path, default=None, help="a llama GGUF whose tokenizer to copy (default: bundled)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        f16 = Path(tmp) / "f16.gguf"
        write_f16(f16, args.like or default_model_path())
        done = subprocess.run([args.quantize, "--token-embedding-type", "q4_k", str(f16), str(args.out), "Q4_K_M"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"llama-quantize failed ({done.returncode}):\n{done.stderr[-4000:]}")
    types: dict[str, int] = {}
    for t in gguf.GGUFReader(args.out).tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    print(f"wrote {args.out}: {args.out.stat().st_size:,} bytes; tensors {types}")


if __name__ == "__main__":
    main()
