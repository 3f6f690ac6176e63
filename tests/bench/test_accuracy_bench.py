"""bench accuracy's own arithmetic, without llama.cpp: llama-perplexity's windows (BOS in front where the
vocabulary adds one), the scored half's NLL and full-vocabulary KL against a direct computation, the figures
read from a llama-perplexity log (whose table header and PPL(Q)-PPL(base) line name the same words), and the
token ids read back from its base file."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from bench.accuracy.perplexity import _figure, base_tokens, score_window, windows

LOG = """chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1      12.9163 ±    1.2031       0.00165 ±    0.00519       0.00290 ±    0.00016     1.440 ±  0.120 %    97.647 ±  0.950 %
====== Perplexity statistics ======
Mean PPL(Q)                   :  13.021513 ±   1.109783
Mean PPL(base)                :  12.996902 ±   1.107117
Mean PPL(Q)/PPL(base)         :   1.001894 ±   0.002506
Mean PPL(Q)-PPL(base)         :   0.024611 ±   0.032645
Mean    KLD:   0.002996 ±   0.000083
99.0%   KLD:   0.012501
Median  KLD:   0.002473
Same top p: 97.255 ± 0.512 %
0.37.498.674 I perplexity: 36.74 seconds per pass - ETA 0.38.565.296 I Final estimate: PPL = 12.9969 +/- 1.10712
"""


def test_figures_from_a_llama_perplexity_log() -> None:
    assert _figure(r"Mean PPL\(Q\)", LOG) == 13.021513
    assert _figure(r"Mean PPL\(base\)", LOG) == 12.996902
    assert _figure(r"Mean\s+KLD", LOG) == 0.002996
    assert _figure(r"99\.0%\s+KLD", LOG) == 0.012501
    assert _figure(r"Same top p", LOG) == 97.255
    assert _figure(r".*Final estimate: PPL", LOG) == 12.9969
    assert _figure(r"Maximum KLD", LOG) is None


def test_windows_and_base_file(tmp_path: Path) -> None:
    ids = list(range(10, 31))   # 21 tokens: two windows of 8, the rest unused
    assert windows(ids, 8, None) == [ids[:8], ids[8:16]]
    assert windows(ids, 8, 1) == [[1, *ids[1:8]], [1, *ids[9:16]]]
    base = tmp_path / "base.bin"
    base.write_bytes(b"_logits_" + np.array([8, 100, 2], dtype=np.int32).tobytes()
                     + np.array(ids[:16], dtype=np.int32).tobytes() + b"\0" * 64)
    assert base_tokens(base) == (8, ids[:16])


def test_score_window_against_a_direct_computation() -> None:
    generator = torch.Generator().manual_seed(0)
    window = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = torch.randn(8, 12, generator=generator)
    quant = ref + 0.3 * torch.randn(8, 12, generator=generator)
    sums = score_window(quant, ref, window)
    scored = range(4, 7)   # positions n/2 .. n-2 predict tokens n/2+1 .. n-1
    assert sums["count"] == 3
    nll = -sum(torch.log_softmax(quant[i].double(), -1)[window[i + 1]].item() for i in scored)
    assert math.isclose(sums["nll_quant"], nll, rel_tol=1e-9)
    p = [torch.softmax(ref[i].double(), -1) for i in scored]
    kl = sum((pi * (pi.log() - torch.log_softmax(quant[i].double(), -1))).sum().item() for pi, i in zip(p, scored))
    assert math.isclose(sums["kl"], kl, rel_tol=1e-9) and kl > 0
    same = score_window(ref, ref, window)
    assert same["kl"] == 0 and same["same_top"] == 3 and same["nll_quant"] == same["nll_float"]
