"""Seeded, reproducible workloads: the same token ids for every system."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class OfflineRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that pick `offline_workload`'s requests, the same in every bench that takes them."""
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)


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


def fixed_workload(num_requests: int, prompt_tokens: int, output_tokens: int, vocab_high: int,
                   salt: int = 0) -> list[OfflineRequest]:
    """num_requests prompts of exactly prompt_tokens ids in [100, vocab_high), a fixed pattern per request
    (another `salt`, other prompts: a warm-up that leaves the timed prompts out of the prefix cache)."""
    return [OfflineRequest([100 + (i * 7919 + j * 31 + salt * 104729) % (vocab_high - 100)
                            for j in range(prompt_tokens)], output_tokens) for i in range(num_requests)]


def mixed_workload(num_requests: int, chat_prompt: tuple[int, int], document_prompt: tuple[int, int],
                   document_share: float, output_tokens: int, vocab_low: int = 100, vocab_high: int = 40000,
                   seed: int = 0) -> tuple[list[OfflineRequest], list[str]]:
    """Chats and documents in a seeded order (each request a document with probability document_share),
    prompt lengths uniform in each class's (min, max); the requests and each one's class."""
    rng = random.Random(seed)
    requests, classes = [], []
    for _ in range(num_requests):
        is_document = rng.random() < document_share
        low, high = document_prompt if is_document else chat_prompt
        requests.append(OfflineRequest([rng.randrange(vocab_low, vocab_high) for _ in range(rng.randint(low, high))],
                                       output_tokens))
        classes.append("document" if is_document else "chat")
    return requests, classes


def arrival_times(num_requests: int, rate: float | None, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process at `rate` requests/s,
    or all at t=0 when rate is None or infinite (a fixed-concurrency run decides its own pacing)."""
    if rate is None or rate == float("inf"):
        return [0.0] * num_requests
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    rng = random.Random(seed + 1)   # not the prompt stream: changing the rate keeps the prompts
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def warmup_workload(num_requests: int = 2, output_tokens: int = 4, vocab_low: int = 100,
                    vocab_high: int = 40000) -> list[OfflineRequest]:
    """Short requests from another seed, so warming a system up cannot prime a prefix cache for the run."""
    return offline_workload(num_requests, min_prompt=16, max_prompt=32, output_tokens=output_tokens,
                            vocab_low=vocab_low, vocab_high=vocab_high, seed=10_007)
