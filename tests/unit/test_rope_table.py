"""RotaryEmbedding.cos_sin's lookup tables give the same bits as computing the positions directly,
whichever batch a position comes in and however far the tables have grown."""

import torch

from conveyor.model.layers import RotaryEmbedding


def _assert_same(rotary: RotaryEmbedding, positions: list[int]) -> None:
    index = torch.tensor(positions, dtype=torch.long)
    cos, sin = rotary.cos_sin(index)
    want_cos, want_sin = rotary.compute(index)
    assert cos.shape == want_cos.shape == (len(positions), rotary.inv_freq.shape[0] * 2)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    for i, position in enumerate(positions):   # alone, as a one-token decode step computes it
        one_cos, one_sin = rotary.compute(torch.tensor([position]))
        assert torch.equal(cos[i], one_cos[0]) and torch.equal(sin[i], one_sin[0])


def test_lookup_matches_direct_computation_as_the_tables_grow():
    rotary = RotaryEmbedding(64, 1_000_000.0, None)
    _assert_same(rotary, [0, 1, 7, 1023])
    assert rotary._tables is not None and rotary._tables[0].shape[0] == 1024
    _assert_same(rotary, [5, 1024, 3000])              # grows past its first length
    assert rotary._tables[0].shape[0] == 4096
    _assert_same(rotary, list(range(2040, 2060)) + [32767])
    assert rotary._tables[0].shape[0] == 32768


def test_lookup_matches_with_scaling_and_an_empty_batch():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    rotary = RotaryEmbedding(128, 500000.0, scaling, freq_factors=torch.linspace(1.0, 2.0, 64))
    _assert_same(rotary, [3, 17, 8191, 9000])
    cos, sin = rotary.cos_sin(torch.zeros(0, dtype=torch.long))
    assert cos.shape == sin.shape == (0, 128)
