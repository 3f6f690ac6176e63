"""transformers on the same weights: one request at a time, static padded batches, and `generate_batch`.

The model is loaded from the same GGUF file conveyor reads (dequantized to float32 by transformers),
so both compute with identical weight values. Each function returns offline figures: elapsed time
and the output tokens actually produced.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
from pathlib import Path

from bench.workloads import OfflineRequest

INSTALL_HINT = "pip install -e '.[bench]' (transformers==5.23.0, accelerate, psutil)"


def missing() -> str | None:
    """None if the transformers peers can run, else the one line that says how to install them."""
    for module in ("transformers", "accelerate", "gguf"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed: {INSTALL_HINT}"
    return None


def load(model_path: Path, threads: int, dtype: str = "float32"):  # -> transformers.PreTrainedModel
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()
    if model_path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                     dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype))
    return model.eval()


def run_sequential(model, requests: list[OfflineRequest], warm: list[OfflineRequest],
                   on_done: Callable[[], None] | None = None) -> dict:
    """`generate()` one request at a time, as a naive server does."""
    import torch

    def one(r: OfflineRequest) -> int:
        ids = torch.tensor([r.prompt_token_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.max_tokens,
                             min_new_tokens=r.max_tokens, do_sample=False, pad_token_id=0)
        return out.shape[1] - ids.shape[1]

    with torch.inference_mode():
        for r in warm:
            one(r)
        total = 0
        start = time.perf_counter()
        for r in requests:
            total += one(r)
            if on_done is not None:
                on_done()
        elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": total}


def run_static(model, requests: list[OfflineRequest], warm: list[OfflineRequest], batch_size: int,
               on_done: Callable[[], None] | None = None) -> dict:
    """Consecutive requests in left-padded batches of `batch_size`; a batch ends when its longest output does."""
    import torch

    def one(batch: list[OfflineRequest]) -> int:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        new = max(r.max_tokens for r in batch)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
        return (out.shape[1] - width) * len(batch)   # no EOS can end a row early (min_new_tokens)

    with torch.inference_mode():
        one(warm)
        total = 0
        start = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            total += one(batch)
            if on_done is not None:
                for _ in batch:
                    on_done()
        elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": total, "batch_size": batch_size}


def run_generate_batch(model, requests: list[OfflineRequest], warm: list[OfflineRequest], max_batch_tokens: int,
                       page_size: int = 256) -> dict:
    """transformers' continuous batching. On CPU it needs psutil and an explicit num_blocks; eos_token_id=-1
    keeps every output at exactly max_tokens."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    logging.getLogger("transformers.generation.continuous_batching").setLevel(logging.ERROR)
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    num_blocks = len(requests) * -(-longest // page_size) + 8
    max_tokens = max(r.max_tokens for r in requests)

    def one(reqs: list[OfflineRequest], new: int) -> dict:
        gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
        cb = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, page_size=page_size)
        return model.generate_batch([r.prompt_token_ids for r in reqs], generation_config=gen,
                                    continuous_batching_config=cb, progress_bar=False)

    # No inference_mode here: the manager's thread updates tensors created by this one, which
    # inference mode forbids ("Inplace update to inference tensor outside InferenceMode").
    one(warm, 4)
    start = time.perf_counter()
    outputs = one(requests, max_tokens)
    elapsed = time.perf_counter() - start
    produced = [len(o.generated_tokens) for o in outputs.values() if o.error is None]
    if len(produced) < len(requests):
        errors = sorted({str(o.error)[:200] for o in outputs.values() if o.error is not None})
        raise RuntimeError(f"{len(requests) - len(produced)} of {len(requests)} requests failed: {errors[:3]}")
    return {"elapsed_s": elapsed, "output_tokens": sum(produced), "max_batch_tokens": max_batch_tokens,
            "num_blocks": num_blocks, "page_size": page_size, "completed": len(produced),
            "failed": len(requests) - len(produced)}
