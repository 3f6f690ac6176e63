"""The server's grammar admission with a stand-in compiler: size limits refuse before compiling, a
repeated or concurrent spec compiles once, a compile past the time limit is a 400 that sticks, a
queued compile nobody waits for never runs, busy threads are a 503, and the verdict cache is bounded."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest

from conveyor.config import GrammarLimits
from conveyor.errors import InvalidRequest, ServerBusy
from conveyor.sampling_params import StructuredOutputsParams as Spec
from conveyor.server import grammar_gate
from conveyor.server.grammar_gate import GrammarGate


class FakeCompiler:
    vocab_size = 100
    is_built = True

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.release = threading.Event()
        self.slow: set[str] = set()
        self.seconds: dict[str, float] = {}

    def compile(self, spec: Spec) -> str:
        self.calls[spec.key] += 1
        if spec.key in self.slow:
            self.release.wait(30)
        time.sleep(self.seconds.get(spec.key, 0.0))
        return "dead" if spec.regex == "dead" else "ok"


@pytest.fixture(autouse=True)
def _no_xgrammar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar_gate, "can_start", lambda compiled, vocab_size: compiled != "dead")


def gate(compiler: FakeCompiler, **limits: object) -> GrammarGate:
    return GrammarGate(compiler, GrammarLimits(**{"timeout_s": 5.0, **limits}))   # type: ignore[arg-type]


def test_limits_refuse_before_any_compile() -> None:
    compiler = FakeCompiler()
    g = gate(compiler, max_choices=10, max_bytes=2000, max_regex_chars=50)
    refused = [
        (Spec(choice=tuple(f"c{i}" for i in range(11))), "--max-grammar-choices"),
        (Spec(json={"type": "object", "properties": {"a": {"enum": list(range(6))}, "b": {"anyOf": [
            {"const": 1}, {"enum": [1, 2, 3, 4]}]}}}), "--max-grammar-choices"),
        (Spec(json='{"enum": [' + ",".join(["1"] * 11) + "]}"), "--max-grammar-choices"),
        (Spec(grammar="root ::= " + '"a" | ' * 400 + '"a"'), "--max-grammar-bytes"),
        (Spec(regex="a" * 51), "--max-regex-chars"),
    ]
    for spec, flag in refused:
        with pytest.raises(InvalidRequest, match=flag):
            asyncio.run(g.admit(spec, "structured_outputs"))
    assert not compiler.calls


def test_a_repeated_or_concurrent_spec_compiles_once() -> None:
    compiler = FakeCompiler()
    g = gate(compiler)

    async def main() -> None:
        await asyncio.gather(*(g.admit(Spec(regex="[a-z]+"), "p") for _ in range(5)))
        await g.admit(Spec(regex="[a-z]+"), "p")

    asyncio.run(main())
    assert compiler.calls == {"regex:[a-z]+": 1}


def test_a_grammar_no_token_can_open_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="no text this model's tokens can write"):
        asyncio.run(gate(FakeCompiler()).admit(Spec(regex="dead"), "guided_regex"))


def test_past_the_time_limit_a_400_that_sticks_and_queued_work_nobody_waits_for_never_runs() -> None:
    compiler = FakeCompiler()
    compiler.slow = {"regex:slow", "regex:queued"}
    g = gate(compiler, timeout_s=0.3, max_concurrent_compiles=1)

    async def main() -> None:
        with pytest.raises(InvalidRequest, match="--grammar-timeout"):
            await g.admit(Spec(regex="slow"), "p")
        with pytest.raises(InvalidRequest, match="--grammar-timeout"):   # no second compile
            await g.admit(Spec(regex="slow"), "p")
        with pytest.raises(ServerBusy):   # the only thread is still on "slow"
            await g.admit(Spec(regex="other"), "p")
        leaving = asyncio.ensure_future(g.admit(Spec(regex="queued"), "p"))
        await asyncio.sleep(0.05)
        leaving.cancel()   # the client left before a thread took it
        await asyncio.gather(leaving, return_exceptions=True)
        compiler.release.set()
        await g.admit(Spec(regex="after"), "p")   # the thread is free again

    asyncio.run(main())
    assert compiler.calls == {"regex:slow": 1, "regex:after": 1}


def test_the_time_limit_counts_compiling_not_waiting_for_a_thread() -> None:
    compiler = FakeCompiler()
    compiler.seconds = {"regex:first": 0.6, "regex:second": 0.6}
    g = gate(compiler, timeout_s=1.0, max_concurrent_compiles=1)

    async def main() -> None:
        # "second" waits 0.6 s for the thread, then compiles in 0.6 s: 1.2 s in all, within the limit.
        await asyncio.gather(g.admit(Spec(regex="first"), "p"), g.admit(Spec(regex="second"), "p"))

    asyncio.run(main())
    assert list(g._verdicts.values()) == [None, None] and compiler.calls == {"regex:first": 1, "regex:second": 1}


def test_the_verdict_cache_is_bounded() -> None:
    compiler = FakeCompiler()
    g = gate(compiler, cache_size=2)

    async def main() -> None:
        for pattern in ("a", "b", "c", "a"):
            await g.admit(Spec(regex=pattern), "p")

    asyncio.run(main())
    assert compiler.calls["regex:a"] == 2 and len(g._verdicts) == 2
