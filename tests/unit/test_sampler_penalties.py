"""Sampler on random and handcrafted logits (the helpers of test_sampler.py): penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from test_sampler import VOCAB, greedy, make_row, random_logits, sampler  # noqa: F401 - sampler: the fixture

from conveyor.runtime.sampler import Sampler, apply_penalties
from conveyor.sampling_params import SamplingParams


# ---------------------------------------------------------------- penalties


def test_no_penalties_is_identity() -> None:
    logits = random_logits(2, seed=11)
    assert apply_penalties(logits, [make_row(output=[1, 2]), make_row(greedy(), prompt=[3])]) is logits


def test_repetition_penalty_exact() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1, 0.5, 0.0]])
    row = make_row(SamplingParams(repetition_penalty=2.0), prompt=[2, 5], output=[0, 0])
    penalised = apply_penalties(logits, [row])
    # seen tokens 0 (output), 2 and 5 (prompt): positive logits divide, non-positive multiply
    assert torch.allclose(penalised, torch.tensor([[1.0, 1.9, -2.0, -1.1, 0.5, 0.0]]))


def test_frequency_and_presence_apply_to_output_only() -> None:
    logits = torch.tensor([[2.0, 1.9, 1.0, 0.0]])
    frequency = make_row(SamplingParams(frequency_penalty=0.5), prompt=[2, 2, 2], output=[0, 0, 1])
    presence = make_row(SamplingParams(presence_penalty=0.5), prompt=[2, 2, 2], output=[0, 0, 1])
    both = make_row(SamplingParams(frequency_penalty=0.25, presence_penalty=-1.0, repetition_penalty=0.5),
                    prompt=[3], output=[0, 0, 1])
    penalised = apply_penalties(logits.expand(3, 4).clone(), [frequency, presence, both])
    expected = torch.tensor([
        [2.0 - 2 * 0.5, 1.9 - 0.5, 1.0, 0.0],
        [2.0 - 0.5, 1.9 - 0.5, 1.0, 0.0],
        [2.0 / 0.5 - 2 * 0.25 + 1.0, 1.9 / 0.5 - 0.25 + 1.0, 1.0, 0.0 * 0.5],
    ])
    assert torch.allclose(penalised, expected)


def test_penalties_only_touch_their_rows() -> None:
    logits = random_logits(3, seed=12)
    rows = [make_row(output=[1, 2]), make_row(SamplingParams(frequency_penalty=1.0), output=[4]),
            make_row(prompt=[1])]
    penalised = apply_penalties(logits, rows)
    assert torch.equal(penalised[0], logits[0]) and torch.equal(penalised[2], logits[2])
    assert penalised[1, 4] == logits[1, 4] - 1.0


@pytest.mark.parametrize("params,prompt,output", [
    (greedy(repetition_penalty=1.5), [0], []),
    (greedy(repetition_penalty=1.5), [], [0]),
    (greedy(frequency_penalty=0.3), [], [0]),
    (greedy(presence_penalty=0.2), [], [0]),
])
def test_penalty_flips_greedy_choice(sampler: Sampler, params: SamplingParams, prompt: list[int],
                                     output: list[int]) -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 0], logits[:, 1] = 2.0, 1.9
    rows = [make_row(params, prompt=prompt, output=output), make_row(greedy(), prompt=prompt, output=output)]
    assert sampler.sample(logits, rows).token_ids == [1, 0]


def test_frequency_penalty_scales_with_count(sampler: Sampler) -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 0], logits[:, 1] = 2.0, 1.5                             # gap 0.5 > 0.3 but < 2 * 0.3
    params = greedy(frequency_penalty=0.3)
    rows = [make_row(params, output=[0]), make_row(params, output=[0, 0])]
    assert sampler.sample(logits, rows).token_ids == [0, 1]


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached(sampler: Sampler) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 11], logits[0, 12], logits[0, 13] = 5.0, 4.0, 3.0, 2.0
    params = greedy(min_tokens=3, stop_token_ids=[11, 12], ignore_eos=True)
    eos = frozenset({10})
    assert [sampler.sample(logits, [make_row(params, output=[1] * n, eos=eos)]).token_ids[0]
            for n in range(5)] == [13, 13, 13, 10, 10]


def test_min_tokens_random_rows_never_stop_early(sampler: Sampler) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 8.0                                                # eos would dominate otherwise
    rows = [make_row(SamplingParams(min_tokens=2, stop_token_ids=[1, 999], seed=i % 3 or None), output=[5],
                     eos=frozenset({0, 2})) for i in range(2000)]
    tokens = set(sampler.sample(logits.expand(2000, VOCAB), rows).token_ids)
    assert tokens.isdisjoint({0, 1, 2}) and len(tokens) > 10


def test_min_tokens_zero_leaves_eos(sampler: Sampler) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 8.0
    assert sampler.sample(logits, [make_row(greedy(), eos=frozenset({0}))]).token_ids == [0]


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0])
def test_logprobs_of_sampled_token_and_top_n(sampler: Sampler, temperature: float) -> None:
    logits = random_logits(5, seed=13)
    counts = [0, 1, 5, 20, None]
    rows = [make_row(SamplingParams(temperature=temperature, logprobs=n)) for n in counts]
    out = sampler.sample(logits, rows)
    # pre-temperature: the reported distribution is the model's, whatever temperature was used to sample
    expected = logits.log_softmax(dim=-1)
    for i, n in enumerate(counts):
        entry = out.logprobs[i]
        if n is None:
            assert entry is None
            continue
        assert entry is not None and entry.token_id == out.token_ids[i]
        assert isinstance(entry.logprob, float)
        assert math.isclose(entry.logprob, expected[i, entry.token_id].item(), abs_tol=1e-5)
        assert len(entry.top) == n
        assert [token for token, _ in entry.top] == expected[i].topk(n).indices.tolist()
        values = [value for _, value in entry.top]
        assert values == sorted(values, reverse=True)
        assert all(math.isclose(v, expected[i, t].item(), abs_tol=1e-5) for t, v in entry.top)


def test_logprobs_zero_gives_only_sampled_token(sampler: Sampler) -> None:
    out = sampler.sample(random_logits(1, seed=14), [make_row(SamplingParams(logprobs=0))])
    entry = out.logprobs[0]
    assert entry is not None and entry.top == [] and entry.token_id == out.token_ids[0]


def test_logprobs_after_penalties(sampler: Sampler) -> None:
    logits = random_logits(1, seed=15)
    row = make_row(greedy(repetition_penalty=1.7, frequency_penalty=0.4, logprobs=VOCAB // 5), prompt=[3, 4],
                   output=[4, 9, 9])
    entry = sampler.sample(logits, [row]).logprobs[0]
    expected = apply_penalties(logits, [row]).log_softmax(dim=-1)
    assert entry is not None
    assert math.isclose(entry.logprob, expected[0].max().item(), abs_tol=1e-5)
    assert [t for t, _ in entry.top] == expected[0].topk(VOCAB // 5).indices.tolist()


def test_logprobs_are_taken_before_min_tokens_mask(sampler: Sampler) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 8.0
    row = make_row(greedy(min_tokens=1, logprobs=3), eos=frozenset({0}))
    out = sampler.sample(logits, [row])
    entry = out.logprobs[0]
    assert out.token_ids[0] != 0
    # the snapshot is taken before the min_tokens mask: the blocked eos still shows as the model's top token
    assert entry is not None and entry.top[0][0] == 0
    assert all(math.isfinite(v) for _, v in entry.top) and math.isfinite(entry.logprob)
