"""Serving figures from per-request records, named and computed as vLLM's `bench serve` reports them."""

from __future__ import annotations

import statistics

from bench.serving.client import ServingRun

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution_ms(values_s: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 in milliseconds."""
    values = [v * 1000 for v in values_s]
    out = {"mean": statistics.fmean(values) if values else float("nan")}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return out


def summarize(run: ServingRun, ttft_limit_s: float | None = None, tpot_limit_s: float | None = None) -> dict:
    """Every figure of one serving run; failed requests are counted and left out of the rest."""
    ok = [r for r in run.records if r.error is None and r.e2e_s is not None]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    itls = [gap for r in ok for gap in r.itls_s]
    duration = run.duration_s
    fig = {
        "num_requests": len(run.records),
        "completed": len(ok),
        "failed": len(run.records) - len(ok),
        "errors": sorted({r.error for r in run.records if r.error})[:5],
        "duration_s": duration,
        "rate_req_s": run.rate,
        "max_concurrency": run.max_concurrency,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tokens_requested": sum(r.max_tokens for r in ok),
        "chunk_tokens": sum(r.chunk_tokens for r in ok),
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ok),
        "usage_reported": all(r.usage_tokens is not None for r in ok) if ok else False,
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / duration,
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution_ms(tpots),
        "itl_ms": distribution_ms(itls),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok]),
    }
    if ttft_limit_s is not None or tpot_limit_s is not None:
        good = [r for r in ok
                if (ttft_limit_s is None or (r.ttft_s is not None and r.ttft_s <= ttft_limit_s))
                and (tpot_limit_s is None or r.tpot_s is None or r.tpot_s <= tpot_limit_s)]
        fig["goodput"] = {"ttft_limit_ms": None if ttft_limit_s is None else ttft_limit_s * 1000,
                          "tpot_limit_ms": None if tpot_limit_s is None else tpot_limit_s * 1000,
                          "good_requests": len(good),
                          "requests_per_s": len(good) / duration}
    return fig


def samples(run: ServingRun) -> dict[str, list[float]]:
    """Raw TTFT and ITL samples in ms (rounded to 0.01 ms) for the distribution plots."""
    ok = [r for r in run.records if r.error is None and r.e2e_s is not None]
    return {"ttft_ms": [round(r.ttft_s * 1000, 2) for r in ok if r.ttft_s is not None],
            "itl_ms": [round(gap * 1000, 2) for r in ok for gap in r.itls_s]}
