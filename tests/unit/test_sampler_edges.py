"""Sampler inputs at the edges of what reaches it: impossible tokens in reported logprobs."""

from __future__ import annotations

import math

import torch

from conveyor.logprobs import IMPOSSIBLE_LOGPROB
from conveyor.runtime.sampler import Sampler, SamplingRow
from conveyor.sampling_params import SamplingParams


def test_impossible_tokens_get_openais_finite_logprob() -> None:
    logits = torch.full((1, 8), float("-inf"))
    logits[0, :3] = torch.tensor([2.0, 1.0, 0.5])
    params = SamplingParams(temperature=0, logprobs=5)
    row = SamplingRow(params, [], [], None, frozenset())
    out = Sampler().sample(logits, [row])
    entry = out.logprobs[0]
    assert entry is not None and entry.token_id == 0
    values = [logprob for _, logprob in entry.top]
    assert all(math.isfinite(v) for v in values), values
    assert values[3:] == [IMPOSSIBLE_LOGPROB, IMPOSSIBLE_LOGPROB]
