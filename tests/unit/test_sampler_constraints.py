"""Sampler constraints: logit_bias, the grammar's allowed-token bitmask, and how they meet min_tokens."""

from __future__ import annotations

import pytest
import torch

from conveyor.errors import InvalidRequest
from conveyor.runtime.sampler import Sampler, SamplingRow, make_generator, unpack_bitmask
from conveyor.sampling_params import SamplingParams, StructuredOutputsParams

VOCAB = 100
EOS = 7


def pack(allowed: set[int], vocab: int = VOCAB) -> torch.Tensor:
    """The packed int32 row xgrammar fills: bit j of word w allows token 32 * w + j."""
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for token in allowed:
        words[token // 32] |= 1 << (token % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def row(params: SamplingParams, allowed: set[int] | None = None, output: list[int] | None = None) -> SamplingRow:
    return SamplingRow(params, [], list(output or []), make_generator(params), frozenset({EOS}),
                       None if allowed is None else pack(allowed))


def logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_unpack_bitmask_round_trips_every_bit_including_the_sign_bit() -> None:
    allowed = {0, 5, 31, 32, 63, 64, 95, 99}
    unpacked = unpack_bitmask(pack(allowed).unsqueeze(0), VOCAB)
    assert unpacked.shape == (1, VOCAB)
    assert set(unpacked[0].nonzero().squeeze(1).tolist()) == allowed


def test_only_allowed_tokens_are_sampled_greedy_and_random_while_free_rows_are_untouched() -> None:
    sampler = Sampler()
    raw = logits(4, seed=1)
    allowed = {3, 40, 77}
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, seed=3), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=4)]
    rows = [row(params[0], allowed), row(params[1], allowed), row(params[2]), row(params[3])]
    for _ in range(20):
        out = sampler.sample(raw, rows)
        assert out.token_ids[0] in allowed and out.token_ids[1] in allowed
        assert out.token_ids[0] == max(allowed, key=lambda t: raw[0, t])
        assert out.token_ids[2] == int(raw[2].argmax())
    alone = Sampler().sample(raw[3:4], [row(SamplingParams(temperature=1.0, seed=4))])
    batched = Sampler().sample(raw, [row(params[0], allowed), row(params[1], allowed), row(params[2]),
                                     row(SamplingParams(temperature=1.0, seed=4))])
    assert batched.token_ids[3] == alone.token_ids[0]   # a free row does not feel its constrained mates


@pytest.mark.parametrize("options", [dict(min_p=0.9), dict(top_k=2), dict(top_p=0.05), dict(logprobs=3),
                                     dict(min_p=0.5, top_k=1, top_p=0.1, logprobs=0, repetition_penalty=2.0)])
def test_filters_and_logprobs_never_pick_a_token_the_grammar_refuses(options: dict) -> None:
    # The allowed tokens are the least likely ones: a filter applied before the mask would keep none of them.
    raw = logits(2, seed=5)
    allowed = set(raw[0].argsort()[:3].tolist()) & set(raw[1].argsort()[:3].tolist()) or {int(raw[0].argmin())}
    rows = [row(SamplingParams(temperature=1.0, seed=seed, **options), allowed) for seed in (1, 2)]
    for _ in range(30):
        assert set(Sampler().sample(raw, rows).token_ids) <= allowed


def test_grammar_end_wins_over_min_tokens() -> None:
    """At the grammar's end only eos is allowed; min_tokens must not leave a row with nothing to sample."""
    params = SamplingParams(temperature=0, min_tokens=10, max_tokens=20)
    out = Sampler().sample(logits(1), [row(params, allowed={EOS}, output=[1, 2])])
    assert out.token_ids == [EOS]
    # While the grammar allows more than eos, min_tokens still holds eos back.
    raw = logits(1, seed=2)
    raw[0, EOS] = 100.0
    out = Sampler().sample(raw, [row(params, allowed={EOS, 11}, output=[1, 2])])
    assert out.token_ids == [11]


def test_logit_bias_moves_greedy_choice_and_is_per_row() -> None:
    raw = logits(2, seed=5)
    worst = int(raw[0].argmin())
    biased = SamplingParams(temperature=0, logit_bias={worst: 100.0})
    out = Sampler().sample(raw, [row(biased), row(SamplingParams(temperature=0))])
    assert out.token_ids == [worst, int(raw[1].argmax())]
    best = int(raw[0].argmax())
    banned = SamplingParams(temperature=0, logit_bias={best: -100.0})
    assert Sampler().sample(raw[:1], [row(banned)]).token_ids[0] != best


def test_logit_bias_shows_in_logprobs_like_penalties() -> None:
    raw = logits(1, seed=6)
    params = SamplingParams(temperature=0, logit_bias={9: 5.0}, logprobs=0)
    out = Sampler().sample(raw, [row(params)])
    shifted = raw.clone()
    shifted[0, 9] += 5.0
    expected = shifted.log_softmax(-1)[0, out.token_ids[0]].item()
    assert out.logprobs[0] is not None and out.logprobs[0].logprob == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("bias", [{-1: 1.0}, {3: 101.0}, {3: float("nan")}, {True: 1.0}, [1, 2]])
def test_bad_logit_bias_is_refused(bias: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(logit_bias=bias)  # type: ignore[arg-type]
    assert info.value.param == "logit_bias"


def test_structured_outputs_params_take_exactly_one_constraint() -> None:
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    for fields in ({}, {"regex": "a", "choice": ["a"]}, {"json_object": True, "grammar": "root ::= \"a\""}):
        with pytest.raises(InvalidRequest):
            StructuredOutputsParams(**fields)
    with pytest.raises(InvalidRequest):
        StructuredOutputsParams(choice=[])
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(json_object=True))
    assert info.value.param == "ignore_eos"
    # The cache key is canonical: the same schema written in another key order is the same grammar.
    assert (StructuredOutputsParams(json={"a": 1, "b": 2}).key == StructuredOutputsParams(json={"b": 2, "a": 1}).key)
    assert StructuredOutputsParams(json={"a": 1}, strict=True).key != StructuredOutputsParams(json={"a": 1}).key


def test_mask_kernel_matches_its_torch_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor import kernels
    from conveyor.runtime import sampler as sampler_module

    if kernels.library() is None:
        pytest.skip("no C compiler: the torch path is the only one")
    generator = torch.Generator().manual_seed(11)
    vocab = 1000   # not a multiple of 32: the last word is partial
    raw = torch.randn(6, vocab, generator=generator)
    raw[2, :] = float("-inf")
    raw[2, 17] = 0.5
    rows = [0, 2, 3, 5]
    words = (vocab + 31) // 32
    packed = torch.randint(-2**31, 2**31 - 1, (len(rows), words), dtype=torch.int32, generator=generator)
    packed[0, :10] = -1          # all-ones words
    packed[2, :] = 0             # refuses everything: nothing left
    packed[1, 0] = 1 << 17       # row 2 keeps only token 17, its one finite logit
    packed[1, 1:] = 0
    fast, slow = raw.clone(), raw.clone()
    alive_fast = kernels.mask_logits(fast, torch.tensor(rows), packed)
    index = torch.tensor(rows)
    expected = slow.index_select(0, index).masked_fill(~unpack_bitmask(packed, vocab), float("-inf"))
    slow.index_copy_(0, index, expected)
    assert torch.equal(fast, slow)
    assert alive_fast == [True, True, False, True]
    twin = raw.clone()
    monkeypatch.setattr(kernels, "mask_logits", lambda *args: None)   # as without a compiler
    assert sampler_module.mask_refused_tokens_(twin, rows, packed) == alive_fast
    assert torch.equal(twin, slow)
