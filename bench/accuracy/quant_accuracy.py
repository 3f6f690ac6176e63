"""Accuracy of each --quantization against the float model on a fixed text shipped with a package.

    python -m bench quant-accuracy [--model PATH] [--text FILE] [--tokens 1024]

Teacher-forced over the text's first tokens: perplexity per format and top-1 agreement of each
position's argmax with the float model's. The default text is a package's METADATA (never fetched).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from bench import report
from conveyor import kernels
from conveyor.text.gguf_vocab import tokenizer_from_gguf
from conveyor.model.attention import RowSpec, build_metadata
from conveyor.model.checkpoint import resolve_model_path
from conveyor.model.loader import load_model
from conveyor.runtime.kv.cache import KVCache
from conveyor.runtime.model_runner import kernel_tile_size

BLOCK_SIZE = 16


def default_text() -> Path:
    dist = importlib.metadata.distribution("charset-normalizer")
    return Path(str(next(f for f in dist.files or [] if f.name == "METADATA").locate()))


def prefill_logits(model, ids: list[int], kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:  # noqa: ANN001
    """Every position's logits of one prompt, computed as the model runner computes a prompt (its attention
    path: the C kernel where the model runs on the kernels)."""
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    tile = kernel_tile_size(model, BLOCK_SIZE, torch.device("cpu"))
    cache = KVCache(model.arch, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=kv_dtype, transposed_keys=tile > 0)
    meta = build_metadata([RowSpec(token_start=0, num_query=len(ids), context_len=len(ids),
                                   block_table=list(range(num_blocks)))],
                          block_size=BLOCK_SIZE, sliding_window=None, device=torch.device("cpu"), kernel_tile_size=tile)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), meta, cache.layers, torch.arange(len(ids)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench quant-accuracy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--text", default=None)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = parser.parse_args(argv)
    results = {}
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    text_path = Path(args.text) if args.text else default_text()
    ids = tokenizer_from_gguf(path).encode(text_path.read_text(), add_special_tokens=False)[: args.tokens]
    print(f"model {path.name}, text {text_path} ({len(ids)} tokens), cpu {kernels.describe(kernels.cpu_features())}")
    reference = None
    for quantization in ("none", "int8", "gguf") if path.is_file() else ("none", "int8"):
        model = load_model(path, kernel_library=kernels.library(), quantization=quantization)
        start = time.perf_counter()
        logits = prefill_logits(model, ids)
        elapsed = time.perf_counter() - start
        reference = logits if reference is None else reference
        perplexity = F.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:])).exp().item()
        agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        print(f"{quantization:>5}: perplexity {perplexity:.3f}, top-1 agreement with float {agree:.4f}, "
              f"prefill {elapsed:.2f} s")
        results[quantization] = {"perplexity": perplexity, "top1_agreement": agree, "prefill_s": elapsed}
    report.save_run("quant-accuracy", args.out_dir, {"model": str(path), "text": str(text_path), "tokens": len(ids),
                                                     "results": results})
