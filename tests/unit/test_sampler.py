"""Sampler on random and handcrafted logits: greedy, seeds, top-k/top-p/min-p (penalties, min_tokens and logprobs:
test_sampler_penalties.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.runtime import sampler as sampler_module
from conveyor.runtime.sampler import Sampler, SamplingRow, make_generator
from conveyor.sampling_params import SamplingParams

VOCAB = 100


def make_row(params: SamplingParams | None = None, prompt: list[int] | None = None,
             output: list[int] | None = None, eos: frozenset[int] = frozenset()) -> SamplingRow:
    params = params or SamplingParams()
    return SamplingRow(params=params, prompt_token_ids=list(prompt or []), output_token_ids=list(output or []),
                       generator=make_generator(params), eos_token_ids=eos)


def random_logits(num_rows: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=generator) * scale                      # (S, V)


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


@pytest.fixture
def sampler() -> Sampler:
    torch.manual_seed(1234)
    return Sampler()


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax(sampler: Sampler) -> None:
    logits = random_logits(8, seed=0)
    out = sampler.sample(logits, [make_row(greedy()) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert all(isinstance(t, int) for t in out.token_ids)
    assert out.logprobs == [None] * 8


def test_greedy_ties_pick_lowest_id(sampler: Sampler) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, [7, 3, 50]] = 5.0
    assert sampler.sample(logits, [make_row(greedy())]).token_ids == [3]


def test_greedy_rows_unaffected_by_other_rows(sampler: Sampler) -> None:
    logits = random_logits(6, seed=1)
    alone = [sampler.sample(logits[i:i + 1], [make_row(greedy())]).token_ids[0] for i in range(6)]
    mixed_params = [greedy(), SamplingParams(temperature=1.0), greedy(), SamplingParams(seed=3, top_k=5),
                    greedy(repetition_penalty=1.0), SamplingParams(temperature=0.7, top_p=0.5, min_p=0.1)]
    out = sampler.sample(logits, [make_row(p) for p in mixed_params])
    for i in (0, 2, 4):
        assert out.token_ids[i] == alone[i]


def test_greedy_consumes_no_randomness(sampler: Sampler) -> None:
    row = make_row(greedy(seed=5))
    assert row.generator is not None
    generator_state = row.generator.get_state()
    default_state = torch.get_rng_state()
    sampler.sample(random_logits(3, seed=2), [row, make_row(greedy()), make_row(greedy(top_k=3, top_p=0.2))])
    assert torch.equal(row.generator.get_state(), generator_state)
    assert torch.equal(torch.get_rng_state(), default_state)


def test_tiny_temperature_is_greedy(sampler: Sampler) -> None:
    logits = random_logits(4, seed=3)
    out = sampler.sample(logits, [make_row(SamplingParams(temperature=1e-30)) for _ in range(4)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_input_logits_not_modified(sampler: Sampler) -> None:
    logits = random_logits(3, seed=4)
    before = logits.clone()
    rows = [make_row(SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, min_tokens=2, top_k=4,
                                    min_p=0.2, logprobs=3), prompt=[1, 2], output=[3], eos=frozenset({0})),
            make_row(greedy(frequency_penalty=1.0), output=[5, 5]),
            make_row(SamplingParams(seed=9, top_p=0.5))]
    sampler.sample(logits, rows)
    assert torch.equal(logits, before)


def test_rejects_mismatched_rows(sampler: Sampler) -> None:
    with pytest.raises(ValueError):
        sampler.sample(random_logits(2, seed=0), [make_row()])


def test_empty_batch(sampler: Sampler) -> None:
    out = sampler.sample(torch.empty(0, VOCAB), [])
    assert out.token_ids == [] and out.logprobs == []


# ---------------------------------------------------------------- seeds


def _run_steps(sampler: Sampler, target: SamplingParams, others: list[SamplingParams], position: int,
               num_steps: int) -> list[int]:
    """Sample `target` for several steps at `position` among `others`; each request keeps its generator."""
    target_row = make_row(target)
    other_rows = [make_row(p) for p in others]
    tokens = []
    for step in range(num_steps):
        rows = other_rows[:position] + [target_row] + other_rows[position:]
        logits = random_logits(len(rows), seed=100 + step)
        logits[position] = random_logits(1, seed=1000 + step)[0]    # the target's logits depend on the step only
        out = sampler.sample(logits, rows)
        tokens.append(out.token_ids[position])
        target_row.output_token_ids.append(out.token_ids[position])
        for row, token in zip(other_rows, out.token_ids[:position] + out.token_ids[position + 1:]):
            row.output_token_ids.append(token)
    return tokens


@pytest.mark.parametrize("target", [
    SamplingParams(seed=42, temperature=1.5),
    SamplingParams(seed=-7, temperature=0.8, top_k=20, top_p=0.9),
    SamplingParams(seed=2**64 - 1, min_p=0.05, presence_penalty=0.5),
])
def test_same_seed_same_tokens_in_any_batch(sampler: Sampler, target: SamplingParams) -> None:
    others = [SamplingParams(seed=1), SamplingParams(temperature=1.0), greedy(), SamplingParams(seed=42),
              SamplingParams(temperature=2.0, top_k=10), SamplingParams(seed=5, top_p=0.3)]
    alone = _run_steps(sampler, target, [], position=0, num_steps=12)
    mixed_middle = _run_steps(sampler, target, others, position=3, num_steps=12)
    mixed_last = _run_steps(sampler, target, others[:4], position=4, num_steps=12)
    assert alone == mixed_middle == mixed_last
    assert len(set(alone)) > 1      # the generator advances: not the same draw every step


def test_different_seeds_differ(sampler: Sampler) -> None:
    a = _run_steps(sampler, SamplingParams(seed=1, temperature=2.0), [], position=0, num_steps=12)
    b = _run_steps(sampler, SamplingParams(seed=2, temperature=2.0), [], position=0, num_steps=12)
    assert a != b


def test_seeded_rows_leave_default_generator_alone(sampler: Sampler) -> None:
    default_state = torch.get_rng_state()
    sampler.sample(random_logits(3, seed=5), [make_row(SamplingParams(seed=s)) for s in range(3)])
    assert torch.equal(torch.get_rng_state(), default_state)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0, 3.0]), st.sampled_from([0, 1, 5, 50]),
                          st.sampled_from([0.1, 0.9, 1.0]), st.sampled_from([None, 7, 8])),
                min_size=1, max_size=6),
       st.integers(min_value=0, max_value=6))
def test_seeded_row_independent_of_batch_property(others: list[tuple[float, int, float, int | None]],
                                                  position: int) -> None:
    sampler = Sampler()
    target = SamplingParams(seed=7, temperature=1.0, top_k=30, top_p=0.95)
    other_params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s) for t, k, p, s in others]
    position = min(position, len(other_params))
    assert (_run_steps(sampler, target, other_params, position, num_steps=3)
            == _run_steps(sampler, target, [], 0, num_steps=3))


# ---------------------------------------------------------------- top-k / top-p / min-p


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=1.0),
    SamplingParams(temperature=5.0, top_k=1, seed=3),
    SamplingParams(temperature=5.0, top_p=1e-6, seed=4),
    SamplingParams(temperature=5.0, min_p=1.0, seed=5),
    SamplingParams(temperature=1.0, top_p=1e-46),       # 0 in float32: still keeps the best token
    SamplingParams(temperature=1.0, top_p=2.225e-311, seed=6),
])
def test_degenerate_filters_equal_greedy(sampler: Sampler, params: SamplingParams) -> None:
    logits = random_logits(64, seed=6)
    out = sampler.sample(logits, [make_row(params) for _ in range(64)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_k", [2, 5, 17])
def test_top_k_stays_in_top_k(sampler: Sampler, top_k: int) -> None:
    base = random_logits(1, seed=7, scale=0.5)                       # flat: many tokens are plausible
    logits = base.expand(4000, VOCAB)
    allowed = set(base[0].topk(top_k).indices.tolist())
    rows = [make_row(SamplingParams(temperature=2.0, top_k=top_k, seed=(i if i % 2 else None)))
            for i in range(4000)]
    drawn = set(sampler.sample(logits, rows).token_ids)
    assert drawn <= allowed
    assert len(drawn) == top_k                                        # and all of them do occur


def test_top_p_keeps_smallest_prefix_reaching_p(sampler: Sampler) -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])                     # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    logits = torch.full((1, VOCAB), -1e4)
    logits[0, :4] = probs.log()
    for top_p, expected in [(0.4, {1}), (0.75, {1, 3}), (0.9, {1, 3, 2}), (0.97, {0, 1, 2, 3})]:
        rows = [make_row(SamplingParams(top_p=top_p))] * 3000        # unseeded rows carry no state
        assert set(sampler.sample(logits.expand(3000, VOCAB), rows).token_ids) == expected, top_p


def _reference_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """One row at a time: sort, keep the shortest prefix reaching top_p plus anything tied with its last token."""
    kept = torch.zeros_like(logits, dtype=torch.bool)
    for i, row in enumerate(logits.softmax(dim=-1)):
        ranked = row.sort(descending=True).values
        num_kept = int(((ranked.cumsum(0) - ranked) < top_p).sum())
        kept[i] = row >= ranked[num_kept - 1]
    return kept


@pytest.mark.parametrize("num_candidates", [1, 16, 256, 4096])
def test_top_p_candidates_and_full_sort_agree(monkeypatch: pytest.MonkeyPatch, num_candidates: int) -> None:
    # 1000 tokens: peaky rows settle within the candidates, flat rows fall back to the full sort.
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", num_candidates)
    generator = torch.Generator().manual_seed(16)
    scales = torch.tensor([0.1, 0.5, 2.0, 6.0, 12.0]).repeat(4).unsqueeze(1)               # (20, 1)
    logits = torch.randn(20, 1000, generator=generator) * scales                            # (20, 1000)
    logits[0, :10] = 3.0                                                                     # a tie across the cut
    for top_p in (0.05, 0.5, 0.9, 0.999):
        filtered = sampler_module._apply_top_p(logits, torch.full((20, 1), top_p))
        assert torch.equal(filtered > float("-inf"), _reference_top_p(logits, top_p)), top_p


def test_min_p_drops_tokens_below_fraction_of_max(sampler: Sampler) -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = torch.full((1, VOCAB), -1e4)
    logits[0, :4] = probs.log()
    for min_p, expected in [(0.5, {1, 3}), (0.2, {1, 2, 3}), (0.05, {0, 1, 2, 3})]:
        rows = [make_row(SamplingParams(min_p=min_p))] * 3000
        assert set(sampler.sample(logits.expand(3000, VOCAB), rows).token_ids) == expected, min_p


def test_mixed_filters_in_one_batch(sampler: Sampler) -> None:
    base = random_logits(1, seed=8, scale=0.5)
    order = base[0].argsort(descending=True).tolist()
    params = [SamplingParams(top_k=3), SamplingParams(), SamplingParams(top_k=-1, top_p=1.0), greedy()]
    rows = [make_row(params[i % 4]) for i in range(4000)]
    out = sampler.sample(base.expand(4000, VOCAB), rows).token_ids
    assert set(out[0::4]) == set(order[:3])
    assert len(set(out[1::4])) > 20 and len(set(out[2::4])) > 20     # unfiltered rows are not truncated
    assert set(out[3::4]) == {order[0]}


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_distribution_matches_softmax(sampler: Sampler, seeded: bool) -> None:
    torch.manual_seed(0)
    base = random_logits(1, seed=9, scale=1.0)
    num_draws = 20000 if not seeded else 4000
    rows = [make_row(SamplingParams(seed=i if seeded else None)) for i in range(num_draws)]
    tokens = torch.tensor(sampler.sample(base.expand(num_draws, VOCAB), rows).token_ids)
    empirical = torch.bincount(tokens, minlength=VOCAB).float() / num_draws
    expected = base[0].softmax(dim=-1)
    total_variation = 0.5 * (empirical - expected).abs().sum().item()
    assert total_variation < (0.05 if not seeded else 0.1)


def test_temperature_sharpens_distribution(sampler: Sampler) -> None:
    base = random_logits(1, seed=10, scale=1.0)
    top = base[0].argmax().item()
    cold = sampler.sample(base.expand(4000, VOCAB), [make_row(SamplingParams(temperature=0.2))] * 4000).token_ids
    hot = sampler.sample(base.expand(4000, VOCAB), [make_row(SamplingParams(temperature=1.0))] * 4000).token_ids
    assert cold.count(top) > 2 * hot.count(top)
