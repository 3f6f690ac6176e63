"""Seeded, reproducible workloads: the same token ids for every system."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class OfflineRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def offline_workload(num_requests: int = 64, min_prompt: int = 100, max_prompt: int = 500,
                     output_tokens: int = 128, vocab_low: int = 100, vocab_high: int = 40000,
                     seed: int = 0) -> list[OfflineRequest]:
    """Prompt lengths uniform in [min_prompt, max_prompt]; exactly output_tokens out (ignore_eos)."""
    rng = random.Random(seed)
    return [
        OfflineRequest([rng.randrange(vocab_low, vocab_high) for _ in range(rng.randint(min_prompt, max_prompt))],
                       output_tokens)
        for _ in range(num_requests)
    ]
