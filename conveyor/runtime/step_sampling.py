"""A step's logits -> the tokens each sampling row emits, drafts verified.

A row with d draft tokens has logits at d + 1 positions. Position i is sampled as a plain decode
would sample it had drafts 1..i been emitted before it (their history counts for penalties and
min_tokens): greedy rows take the argmax, random rows draw from their own distribution. The row
keeps its leading drafts while each equals the token sampled before it, then emits that sampled
token. For a draft that comes from lookup (a one-hot proposal) this is exact rejection sampling: the
emitted tokens have the model's distribution, and greedy rows emit exactly what they would without
drafts. A seeded generator is rewound to the draws of the tokens emitted, so a seed gives the same
tokens with speculation on or off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from conveyor.core.plan import ScheduledRow
from conveyor.core.request import Request
from conveyor.logprobs import TokenLogprobs
from conveyor.runtime.sampler import Sampler, SamplingRow, skip_draws

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SampledRows:
    emitted: list[list[int]]                       # per sampling row: accepted drafts + one sampled token
    logprobs: list[list[TokenLogprobs | None]]     # per sampling row, one per emitted token
    failed: dict[str, str]                         # request id -> error, for rows that could not be sampled


def sample_rows(sampler: Sampler, logits: torch.Tensor, rows: list[ScheduledRow],
                requests: Mapping[str, Request], generators: Mapping[str, torch.Generator | None],
                allowed: Mapping[str, torch.Tensor] | None = None) -> SampledRows:
    """logits: (sum of rows' num_logits, V), in row order. allowed: for constrained requests, the
    packed bitmask of allowed tokens at each of their row's positions, (num_logits, words) int32."""
    sampling_rows: list[SamplingRow] = []
    for row in rows:
        request = requests[row.request_id]
        drafts = row.draft_token_ids
        masks = allowed.get(row.request_id) if allowed else None
        for i in range(row.num_logits):
            history = request.output_token_ids + drafts[:i] if i else request.output_token_ids
            sampling_rows.append(SamplingRow(request.params, request.prompt_token_ids, history,
                                             generators[row.request_id], request.eos_token_ids,
                                             None if masks is None else masks[i]))
    states = {id(g): (g, g.get_state()) for g in generators.values() if g is not None}
    token_ids, logprobs, failed = _sample(sampler, logits, sampling_rows, rows, states)
    out = SampledRows([], [], failed)
    start = 0
    for row in rows:
        targets = token_ids[start:start + row.num_logits]
        drafts = row.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and targets[accepted] == drafts[accepted]:
            accepted += 1
        out.emitted.append(targets[:accepted + 1])
        out.logprobs.append(logprobs[start:start + accepted + 1])
        generator = generators[row.request_id]
        if generator is not None and accepted < len(drafts):
            # Draws of the discarded positions are taken back: the next step draws what a plain decode would.
            generator.set_state(states[id(generator)][1])
            skip_draws(generator, logits.shape[1], accepted + 1)
        start += row.num_logits
    return out


def _sample(sampler: Sampler, logits: torch.Tensor, sampling_rows: list[SamplingRow], rows: list[ScheduledRow],
            states: dict[int, tuple[torch.Generator, torch.Tensor]]
            ) -> tuple[list[int], list[TokenLogprobs | None], dict[str, str]]:
    """One token per logits row. If the batched call raises, rows are sampled one at a time in order
    (seeded generators rewound first, as the failed call may have drawn), so only a row that fails on
    its own is lost, with token 0 standing in for it."""
    try:
        sampled = sampler.sample(logits, sampling_rows)
        return sampled.token_ids, sampled.logprobs, {}
    except Exception:
        logger.exception("sampling %d rows failed; sampling them one at a time", len(sampling_rows))
    for generator, state in states.values():
        generator.set_state(state)
    owners = [row.request_id for row in rows for _ in range(row.num_logits)]
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    failed: dict[str, str] = {}
    for i, (request_id, row) in enumerate(zip(owners, sampling_rows)):
        try:
            alone = sampler.sample(logits[i:i + 1], [row])
        except Exception as exc:
            logger.exception("sampling request %s failed", request_id)
            failed[request_id] = f"internal error while sampling this request: {exc}"
            token_ids.append(0)
            logprobs.append(None)
        else:
            token_ids += alone.token_ids
            logprobs += alone.logprobs
    return token_ids, logprobs, failed
