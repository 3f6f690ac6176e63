"""The greedy rows' argmax in C (sampling.c) against numpy's: the first index of each row's largest value,
a NaN counting as largest, whatever the row's length, its spans and the threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor import kernels
from conveyor.runtime.sampler import _argmax_rows

from kernel_builds import VARIANTS, library

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler")


def expected(logits: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.argmax(logits.numpy(), axis=-1).astype(np.int64))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("vocab", [1, 15, 17, 16384, 16385, 49152, 151936])
@pytest.mark.parametrize("rows", [1, 3])
def test_matches_numpy_on_random_rows(variant: str, vocab: int, rows: int) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab + rows))
    assert torch.equal(kernels.argmax_rows(logits, library(variant)), expected(logits))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ties_nans_infinities_and_signed_zeros(variant: str) -> None:
    vocab = 40_000
    logits = torch.full((7, vocab), -float("inf"))
    logits[1, [20_000, 5, 39_999]] = 3.0                        # a tie across spans: the first wins
    logits[2, [33_000, 100]] = float("nan")                     # the first NaN wins over any number
    logits[2, 50] = float("inf")
    logits[3, 17_000] = float("inf")
    logits[3, 16_999] = float("inf")
    logits[4] = 0.0
    logits[4, 3] = -0.0                                         # -0 == +0: the first zero
    logits[5, vocab - 1] = -1e30                                # one finite value, last of all
    logits[6, 0] = float("nan")
    got = kernels.argmax_rows(logits, library(variant)).tolist()
    assert got == expected(logits).tolist() == [0, 5, 100, 16_999, 0, vocab - 1, 0]


def test_many_rows_and_a_strided_view() -> None:
    wide = torch.randn(80, 20_000, generator=torch.Generator().manual_seed(3))
    view = wide[:, :17_001]                                     # rows 20,000 floats apart
    assert torch.equal(kernels.argmax_rows(view), expected(view.contiguous()))
    assert torch.equal(_argmax_rows(view), expected(view.contiguous()))


def test_refuses_what_it_does_not_take() -> None:
    assert kernels.argmax_rows(torch.randn(2, 10, dtype=torch.float64)) is None
    assert kernels.argmax_rows(torch.randn(10, 2).t()) is None     # columns not contiguous
    assert kernels.argmax_rows(torch.empty(0, 10)) is None
