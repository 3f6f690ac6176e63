"""A fault in one row's sampling fails that request alone; a fault in a whole model step fails that
step's requests. Every other request produces exactly the tokens it produces without the fault, the
engine keeps stepping, and no KV block stays in use."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.config import EngineConfig
from conveyor.front.llm_engine import LLMEngine
from conveyor.runtime.sampler import Sampler, SamplingRow
from conveyor.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [18, 19], [20, 21, 22, 23, 24]]
VICTIM = 2
PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=1.3, top_k=20, seed=3, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.7, top_p=0.8, seed=5, max_tokens=12, ignore_eos=True)]


def make_engine(checkpoint: Path, max_num_seqs: int = 8) -> LLMEngine:
    return LLMEngine(EngineConfig.from_options(model=str(checkpoint), threads=2, kv_cache_memory="16MiB",
                                               max_num_seqs=max_num_seqs))


def run(engine: LLMEngine, prompts: list[list[int]] = PROMPTS) -> dict[str, tuple[list[int], str | None]]:
    """request id -> (token ids, error) for each prompt, run together in one batch."""
    ids = [engine.add_request(p, PARAMS[i % len(PARAMS)], request_id=f"r{i}") for i, p in enumerate(prompts)]
    results: dict[str, tuple[list[int], str | None]] = {i: ([], None) for i in ids}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            tokens, _ = results[output.request_id]
            results[output.request_id] = (tokens + output.new_token_ids, output.error)
    assert not engine.has_unfinished_requests(), "the engine stopped making progress"
    return results


@pytest.fixture(scope="module")
def baseline(tiny_checkpoint: Path) -> dict[str, tuple[list[int], str | None]]:
    results = run(make_engine(tiny_checkpoint))
    assert all(error is None and len(tokens) == 12 for tokens, error in results.values())
    return results


def test_a_row_whose_sampling_fails_fails_alone(tiny_checkpoint: Path, baseline, monkeypatch) -> None:
    engine = make_engine(tiny_checkpoint)
    original = Sampler.sample
    calls = {"n": 0}

    def sample(self: Sampler, logits, rows: list[SamplingRow]):
        calls["n"] += 1
        # From the third step on, any call that includes the victim's row raises, batched or alone.
        if calls["n"] >= 3 and any(row.prompt_token_ids == PROMPTS[VICTIM] for row in rows):
            raise IndexError("injected sampling fault")
        return original(self, logits, rows)

    monkeypatch.setattr(Sampler, "sample", sample)
    results = run(engine)
    for i in range(len(PROMPTS)):
        tokens, error = results[f"r{i}"]
        if i == VICTIM:
            assert error is not None and "injected sampling fault" in error
            assert tokens == baseline[f"r{i}"][0][:len(tokens)]
        else:
            assert (tokens, error) == baseline[f"r{i}"], f"request r{i} was hurt by another row's fault"
    assert engine.blocks.num_used_blocks == 0
    monkeypatch.undo()
    assert run(engine) == baseline                    # and the engine goes on as before


def test_a_failed_model_step_fails_its_requests_only(tiny_checkpoint: Path, baseline, monkeypatch) -> None:
    # Three requests run at first; the other two wait for a slot, so they are not in step 3.
    engine = make_engine(tiny_checkpoint, max_num_seqs=3)
    runner = engine.runner
    original = runner.execute
    calls = {"n": 0}

    def execute(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected model fault")
        return original(plan)

    monkeypatch.setattr(runner, "execute", execute)
    results = run(engine)
    failed = {rid for rid, (_, error) in results.items() if error is not None}
    assert failed == {"r0", "r1", "r2"}
    assert all("injected model fault" in results[rid][1] for rid in failed)
    for rid in ("r3", "r4"):
        assert results[rid] == baseline[rid], f"{rid} was hurt by a step it was not in"
    assert engine.blocks.num_used_blocks == 0
    monkeypatch.undo()
    assert run(engine, PROMPTS[:3]) == {f"r{i}": baseline[f"r{i}"] for i in range(3)}
    assert engine.blocks.num_used_blocks == 0
