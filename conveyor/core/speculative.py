"""Draft proposers for speculative decoding, and the rule that decides how many drafts a step takes.

A proposer guesses the next tokens of a request from its context; the target model then checks every
guess in one forward pass (a multi-token decode row), and the engine keeps the guesses that equal what
it would have produced anyway. Pure Python: no torch, no threads.

    NgramProposer: prompt lookup. The last n tokens of the context (n from max_n down to min_n) are
    looked up among earlier positions of the same context; the k tokens that followed the latest
    earlier occurrence are the guess. An index per request, extended as tokens arrive, keeps a lookup
    O(max_n) whatever the context length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """Guesses the next tokens of several requests at once, one ask each (request id, token ids, up to
    how many); [] for no guess. State per request is dropped by `forget` when the request ends.
    `cost_per_token_s`: what one more guess costs the proposer (0 for a lookup), weighed by the
    scheduler against what the guess is expected to save."""

    cost_per_token_s: float

    def propose_many(self, asks: Sequence[tuple[str, Sequence[int], int]]) -> list[list[int]]: ...

    def forget(self, request_id: str) -> None: ...


class _NgramIndex:
    """For each n, the latest position that followed each n-gram seen so far (the tail excluded)."""

    __slots__ = ("positions", "indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.positions: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0    # n-grams ending before this position are in the index


class NgramProposer:
    cost_per_token_s = 0.0

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram bounds must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        length = len(token_ids)
        if max_tokens <= 0 or length <= self.min_n:
            return []
        index = self._indexes.get(request_id)
        if index is None or index.indexed > length:   # first call, or a context that shrank: rebuild
            index = self._indexes[request_id] = _NgramIndex(self.min_n, self.max_n)
        # Index every n-gram that ends before the tail's last token, so a lookup never finds the tail itself.
        for end in range(max(index.indexed, self.min_n), length):
            for n, positions in index.positions.items():
                if n <= end:
                    positions[tuple(token_ids[end - n:end])] = end
        index.indexed = length
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = index.positions[n].get(tuple(token_ids[length - n:]))
            if start is not None:
                return list(token_ids[start:min(start + max_tokens, length)])
        return []

    def propose_many(self, asks: Sequence[tuple[str, Sequence[int], int]]) -> list[list[int]]:
        return [self.propose(*ask) for ask in asks]

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


def worth_drafting(acceptance: float, token_cost_s: float, step_s: float, tokens_per_step: float) -> bool:
    """Whether one more draft token raises the step's rate of emitted tokens.

    A step of `step_s` emits `tokens_per_step` tokens (its decodes plus the drafts expected to be
    accepted so far); one more draft adds `token_cost_s` and is accepted with probability `acceptance`.
    It pays when (tokens + acceptance) / (step + cost) > tokens / step. On a memory-bound small batch
    the cost is a sliver of the step and nearly any guess pays; near the compute knee only good ones do.
    """
    return acceptance * step_s > token_cost_s * tokens_per_step
