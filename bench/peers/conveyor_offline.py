"""conveyor through its offline API (`LLM.generate`), with every engine step's stats recorded.

The step stats give the measured decode step time at each batch size, which `limits.py` compares
with the physical floor.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable

from bench.workloads import OfflineRequest


def make_llm(model: str | None, threads: int, max_num_seqs: int, max_num_batched_tokens: int,
             kv_cache_memory: str, dtype: str | None = "float32",
             quantization: str | None = "none"):  # -> conveyor.LLM
    """dtype or quantization None: conveyor's own default."""
    from conveyor import LLM

    options = {k: v for k, v in {"dtype": dtype, "quantization": quantization}.items() if v is not None}
    return LLM(model, threads=threads, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
               kv_cache_memory=kv_cache_memory, **options)


def _params(requests: list[OfflineRequest]) -> list:
    from conveyor import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]


def run(llm, requests: list[OfflineRequest], warm: list[OfflineRequest],
        on_done: Callable[[], None] | None = None) -> dict:
    """All requests submitted at once to one `generate` call (after `warm`); returns figures and per-step stats."""
    llm.generate([r.prompt_token_ids for r in warm], _params(warm), use_tqdm=False)
    engine = llm.engine
    steps = []
    engine_step = engine.step

    def recording_step():  # noqa: ANN202 - the engine's own return type
        num_steps = engine.stats.num_steps
        outputs = engine_step()
        if engine.stats.num_steps > num_steps:   # an empty plan records no step
            steps.append(engine.last_step)
        if on_done is not None:
            for output in outputs:
                if output.finished:
                    on_done()
        return outputs

    engine.step = recording_step
    try:
        start = time.perf_counter()
        outs = llm.generate([r.prompt_token_ids for r in requests], _params(requests), use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        del engine.step
    errors = [o.error for o in outs if o.error]
    return {
        "elapsed_s": elapsed,
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "output_tokens_requested": sum(r.max_tokens for r in requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "num_steps": len(steps),
        "num_preemptions": sum(s.num_preemptions for s in steps),
        "prefix_hit_tokens": sum(s.num_prefix_hit_tokens for s in steps),
        "decode_steps": decode_step_times(steps),
        "step_time_total_s": sum(s.step_time_s for s in steps),
        "avg_rows_per_step": statistics.fmean(s.num_rows for s in steps) if steps else 0.0,
    }


def decode_step_times(steps: list) -> dict[int, dict]:
    """Pure decode steps (no prompt tokens) grouped by batch size: count and median/min step time."""
    by_rows: dict[int, list[float]] = defaultdict(list)
    for s in steps:
        if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0:
            by_rows[s.num_decode_tokens].append(s.step_time_s)
    return {rows: {"num_steps": len(times), "median_s": statistics.median(times), "min_s": min(times)}
            for rows, times in sorted(by_rows.items())}


def single_stream_decode(llm, requests: list[OfflineRequest]) -> dict:
    """Decode tokens/s of requests run one at a time (first token excluded), from request metrics."""
    rates = []
    for r in requests:
        out = llm.generate([r.prompt_token_ids], _params([r]), use_tqdm=False)[0]
        m = out.metrics
        if m is not None and m.first_token_s is not None and m.finished_s is not None and len(out.token_ids) > 1:
            rates.append((len(out.token_ids) - 1) / (m.finished_s - m.first_token_s))
    return {"num_requests": len(rates), "decode_tokens_per_s": statistics.fmean(rates) if rates else 0.0}
