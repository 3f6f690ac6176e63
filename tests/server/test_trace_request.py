"""scripts/trace_request.py, the count docs/architecture.md keeps: its walk on hand-made runs, and one real
streamed chat request traced through a real server on the bundled model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace_request.py"


def load_script():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("trace_request", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_walk_merges_runs_of_one_file_and_counts_each_return_to_a_file_left() -> None:
    trace = load_script()
    runs = [("conveyor/server/app.py", "route", "t"), ("conveyor/server/app.py", "helper", "t"),
            ("conveyor/front/front.py", "add", "t"), ("conveyor/core/scheduler.py", "schedule", "core"),
            ("conveyor/front/front.py", "process", "t"), ("conveyor/server/app.py", "send", "t"),
            ("conveyor/errors.py", "init", "t")]
    segments = trace.walk(runs)
    assert [(s.file, s.functions, s.is_reentry) for s in segments] == [
        ("conveyor/server/app.py", ("route", "helper"), False), ("conveyor/front/front.py", ("add",), False),
        ("conveyor/core/scheduler.py", ("schedule",), False), ("conveyor/front/front.py", ("process",), True),
        ("conveyor/server/app.py", ("send",), True), ("conveyor/errors.py", ("init",), False)]
    floors = trace.walk(runs, by_package=True)
    assert [s.file for s in floors] == ["conveyor/server", "conveyor/front", "conveyor/core", "conveyor/front",
                                        "conveyor/server", "conveyor/*.py"]


def test_the_handoff_walk_keeps_the_functions_that_called_another_files_code() -> None:
    trace = load_script()
    runs = [("conveyor/server/app.py", "route", "t"), ("conveyor/core/request.py", "num_tokens", "t"),
            ("conveyor/front/front.py", "add", "t"), ("conveyor/core/request.py", "append", "t"),
            ("conveyor/server/app.py", "send", "t")]
    recorder = trace.Recorder(first_runs=runs, hands_on={("conveyor/server/app.py", "route"),
                                                          ("conveyor/front/front.py", "add"),
                                                          ("conveyor/server/app.py", "send")})
    handoffs = trace.handoff_runs(recorder)
    assert handoffs == [runs[0], runs[2], runs[4]]
    every = trace.walk_counts(trace.walk(runs))
    assert (every["hops"], every["files"], every["reentries"], every["files_reentered"]) == (5, 3, 2, 2)
    counts = trace.walk_counts(trace.walk(handoffs))
    assert (counts["hops"], counts["files"], counts["reentries"], counts["reentries_after_leaving"],
            counts["files_reentered_after_leaving"]) == (3, 2, 1, 1, 1)


def test_a_traced_streamed_chat_request_walks_from_the_route_through_the_core_and_back() -> None:
    trace = load_script()
    recorder, text = trace.trace(None, max_tokens=8, threads=2)
    assert text == "The capital of France is Paris."
    files = [file for file, _, _ in recorder.first_runs]
    assert files[0].startswith("conveyor/server/")
    for floor in ("conveyor/engine/core.py", "conveyor/core/scheduler.py", "conveyor/runtime/model_runner.py"):
        assert floor in files, floor
    runner = files.index("conveyor/runtime/model_runner.py")
    assert files.index("conveyor/core/scheduler.py") < runner
    assert any(file.startswith("conveyor/server/") for file in files[runner:]), "the outputs never came back"
    segments = trace.walk(recorder.first_runs)
    assert sum(s.is_reentry for s in segments) == len(segments) - len({s.file for s in segments})
    assert recorder.num_calls > len(recorder.first_runs) > 50
    # The handoffs: the route, the core's step and the runner pass the request on; a Request's accessor does not.
    handoffs = {run[:2] for run in trace.handoff_runs(recorder)}
    assert {("conveyor/server/app.py", "build_app.<locals>.chat_completions"), ("conveyor/engine/core.py",
            "EngineCore.step"), ("conveyor/runtime/model_runner.py", "ModelRunner.execute")} <= handoffs
    assert ("conveyor/core/request.py", "Request.num_tokens") in {run[:2] for run in recorder.first_runs}
    assert ("conveyor/core/request.py", "Request.num_tokens") not in handoffs
