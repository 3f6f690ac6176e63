"""The real-file tier: a GGUF file a user downloaded, given with `pytest -m real_model --real-gguf FILE`.

CI has no such file (model hubs are out of reach, and the PyPI packages that carry some come in
hundreds of MB of parts), so these skip there; run them on any Q4_K_M-style file you have.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conveyor import LLM, SamplingParams
from conveyor.model.quant import QuantLinear

pytestmark = pytest.mark.real_model

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Three prime numbers are"]


def test_real_file_runs_in_its_own_formats_and_batched_equals_alone(real_gguf: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="conveyor"):
        llm = LLM(str(real_gguf), kv_cache_memory="256MiB")
    assert "weights kept in the file's formats" in caplog.text
    assert any(isinstance(m, QuantLinear) for m in llm.engine.core.model.modules())
    params = SamplingParams(temperature=0, max_tokens=16)
    batched = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], params)[0] for p in PROMPTS]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert all(o.token_ids for o in batched)
