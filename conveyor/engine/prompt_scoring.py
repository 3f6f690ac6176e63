"""Prompt logprobs (vLLM's prompt_logprobs, completions' echo with logprobs): each prompt token scored
by the logits of the position before it, as the prompt's chunks are computed.

A request that asks has its prompt computed in full (no prefix cache hits) with logits at every
prompt position (ScheduledRow.num_prompt_logits); the runner returns those after the sampling rows'.
Scores are gathered per request across chunks and go to the front once, with its first token. A
request preempted before its first token computes its prompt again: positions already scored are
not scored twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from conveyor.core.plan import ScheduledRow
from conveyor.core.request import Request
from conveyor.logprobs import IMPOSSIBLE_LOGPROB, PromptLogprob

_ROWS_PER_PASS = 256   # log_softmax over (rows, vocab) at a time: bounds the float32 temporaries


class PromptScores:
    """Per request: the prompt's scores so far, position 0 (no context) None, as OpenAI and vLLM write it."""

    def __init__(self) -> None:
        self._scores: dict[str, list[PromptLogprob | None]] = {}

    def add(self, logits: torch.Tensor, rows: Iterable[ScheduledRow], requests: Mapping[str, Request]) -> None:
        """logits (P, V): the rows' `num_prompt_logits` positions, in row order."""
        start = 0
        for row in rows:
            count = row.num_prompt_logits
            if not count:
                continue
            request = requests[row.request_id]
            scores = self._scores.setdefault(row.request_id, [None])
            # Position p scores prompt token p + 1; a recomputed chunk's positions already scored are skipped.
            first_new = len(scores) - 1 - row.start_position
            if 0 <= first_new < count:
                targets = request.prompt_token_ids[row.start_position + first_new + 1:row.start_position + count + 1]
                scores += score_positions(logits[start + first_new:start + count], targets,
                                          request.params.prompt_logprobs or 0)
            start += count

    def take(self, request: Request) -> list[PromptLogprob | None] | None:
        """The whole prompt's scores once they are complete; None before, after, or if not asked for."""
        if request.params.prompt_logprobs is None:
            return None
        scores = self._scores.get(request.request_id)
        if scores is None and request.num_prompt_tokens == 1:
            scores = [None]   # nothing to score: a one-token prompt's only entry is its null
        elif scores is None or len(scores) < request.num_prompt_tokens:
            return None
        self._scores.pop(request.request_id, None)
        return scores

    def drop(self, request_id: str) -> None:
        self._scores.pop(request_id, None)


def score_positions(logits: torch.Tensor, targets: list[int], num_top: int) -> list[PromptLogprob]:
    """logits (P, V) float32, targets: the token after each position -> each target's logprob, rank and
    the position's top `num_top`. Only per-row values are formed (logit - logsumexp): no (P, V) copy."""
    out: list[PromptLogprob] = []
    target_ids = torch.tensor(targets, dtype=torch.long, device=logits.device)                # (P,)
    for first in range(0, len(targets), _ROWS_PER_PASS):
        chunk = logits[first:first + _ROWS_PER_PASS].float()                                  # (C, V)
        norm = chunk.logsumexp(dim=-1, keepdim=True)                                           # (C, 1)
        chosen = chunk.gather(1, target_ids[first:first + _ROWS_PER_PASS].unsqueeze(1))        # (C, 1)
        ranks = (chunk > chosen).sum(dim=-1) + 1                                                # (C,) 1 = best
        top_values, top_ids = chunk.topk(min(num_top, chunk.shape[1]), dim=-1)                 # (C, N)
        chosen = (chosen - norm).nan_to_num(nan=IMPOSSIBLE_LOGPROB, neginf=IMPOSSIBLE_LOGPROB)
        top_values = (top_values - norm).nan_to_num(nan=IMPOSSIBLE_LOGPROB, neginf=IMPOSSIBLE_LOGPROB)
        out += [PromptLogprob(logprob=value, rank=rank, top=list(zip(ids, values)))
                for value, rank, ids, values in zip(chosen.squeeze(1).tolist(), ranks.tolist(),
                                                    top_ids.tolist(), top_values.tolist())]
    return out
