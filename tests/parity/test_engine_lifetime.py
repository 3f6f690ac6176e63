"""An engine the caller drops is freed: nothing the engine or a run pins (the collector's frozen
generation included) keeps its model alive after the last reference goes."""

from __future__ import annotations

import gc
import weakref

from conveyor import LLM, SamplingParams


def test_a_dropped_llm_frees_its_model_after_a_run() -> None:
    llm = LLM(None, kv_cache_memory="64MiB")
    llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    model = weakref.ref(llm.engine.core.model)
    assert gc.get_freeze_count() == 0   # a run thaws what it froze
    del llm
    gc.collect()
    assert model() is None
