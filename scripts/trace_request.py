"""Trace one streamed chat request through a real server and count the files of conveyor it walks through.

    python scripts/trace_request.py [--model PATH] [--max-tokens 8] [--walk] [--json OUT]

The server is the one `conveyor serve --no-core-process` runs (the engine core on a thread of the same
process, so one profiler sees both halves: front and core; a 64 MiB KV cache), on a free loopback port. One streamed
`/v1/chat/completions` request warms it up untraced; the second is traced with `threading.setprofile`
from the moment it is sent until its stream has ended and the server has finished with it.

The walk: every function of a `conveyor/` file that the request runs, in the order each first runs
(repeats, as the core's step loop makes them, count once), on every thread of the server. Its files,
with consecutive runs of one file merged, are the request's hops: `hops` counts the segments, `files`
the distinct files, and `re-entries` = hops - files, the times the walk comes back into a file it had
already left (`files re-entered`: how many distinct files it comes back into). A re-entry whose file still
has a frame on that thread's stack is a call out and back (the file's code called another file's and goes
on with a function of its own): the file was never left. The rest, `re-entries after leaving`, are the walk
coming back into a file none of whose code is running (a later phase, a callback). The same counts over
packages (`conveyor/server`, `conveyor/engine`, ...; the top-level modules as one, `conveyor/*.py`)
show the floors: a walk straight down and back up re-enters each floor once on its way back.

The handoffs: the same walk over the functions that pass the request on, those that called code of
another conveyor file (directly or through a library: a route through Starlette, a callback through the
event loop). A function that only answers from its own file (`Request.num_tokens`, a field check, a
dataclass's `__init__`) is read where it is called, as a reader reads it, and a file the request only
consults drops out of this walk. It is the unit of a hand-drawn request path (route, serving, front, core,
scheduler, runner, model, sampler and back); the walk over every function stays beside it.

`--walk` prints every segment of both walks with the functions first run in it; `--json OUT` writes the
counts and both walks.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import conveyor  # noqa: E402

PACKAGE_DIR = str(Path(conveyor.__file__).resolve().parent) + "/"
PROMPT = "What is the capital of France? Answer in one sentence."


@dataclass
class Recorder:
    """Records the first run of each conveyor function while `active`; a profile hook on every thread."""

    active: bool = False
    first_runs: list[tuple[str, str, str]] = field(default_factory=list)   # (file, function, thread)
    seen: set[tuple[str, str]] = field(default_factory=set)
    on_stack: set[tuple[str, str]] = field(default_factory=set)   # first runs whose file was already running
    hands_on: set[tuple[str, str]] = field(default_factory=set)   # functions that called another file's code
    num_calls: int = 0

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:  # noqa: ANN401
        if event != "call" or not self.active:
            return
        filename = frame.f_code.co_filename
        if not filename.startswith(PACKAGE_DIR):
            return
        self.num_calls += 1
        key = ("conveyor/" + filename[len(PACKAGE_DIR):], frame.f_code.co_qualname)
        caller = frame.f_back   # the nearest conveyor frame above, through any library in between
        while caller is not None and not caller.f_code.co_filename.startswith(PACKAGE_DIR):
            caller = caller.f_back
        if caller is not None and caller.f_code.co_filename != filename:
            self.hands_on.add(("conveyor/" + caller.f_code.co_filename[len(PACKAGE_DIR):],
                               caller.f_code.co_qualname))
        if key not in self.seen:
            self.seen.add(key)
            self.first_runs.append((*key, threading.current_thread().name))
            caller = frame.f_back
            while caller is not None and caller.f_code.co_filename != filename:
                caller = caller.f_back
            if caller is not None:
                self.on_stack.add(key)


@dataclass(frozen=True)
class Segment:
    file: str
    functions: tuple[str, ...]
    is_reentry: bool
    is_return: bool = False   # a re-entry while the file's code is still on the stack: it never left


def package_of(file: str) -> str:
    parts = file.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else "conveyor/*.py"


def walk(first_runs: list[tuple[str, str, str]], by_package: bool = False,
         on_stack: set[tuple[str, str]] | frozenset[tuple[str, str]] = frozenset()) -> list[Segment]:
    """The first runs grouped into segments of one file (or package); a segment whose file came before is a
    re-entry, and a return when its first function ran with its file on the stack (`on_stack`, files only)."""
    segments: list[Segment] = []
    visited: set[str] = set()
    for path, function, _ in first_runs:
        file = package_of(path) if by_package else path
        if segments and segments[-1].file == file:
            last = segments[-1]
            segments[-1] = Segment(file, (*last.functions, function), last.is_reentry, last.is_return)
            continue
        is_reentry = file in visited
        segments.append(Segment(file, (function,), is_reentry, is_reentry and (path, function) in on_stack))
        visited.add(file)
    return segments


def stream_chat(base_url: str, model: str, max_tokens: int) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[len("data: "):])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


def wait_until_idle(engine: Any, timeout_s: float = 10.0) -> None:  # noqa: ANN401
    """Until the core holds no request: the stream ends before the core has freed the request's blocks."""
    deadline = time.monotonic() + timeout_s
    while engine.core.scheduler.num_running + engine.core.scheduler.num_waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)


def trace(model: str | None, max_tokens: int, threads: int) -> tuple[Recorder, str]:
    """Start the server (its threads inherit the hook), warm it up, trace one streamed chat request."""
    from conveyor.config import EngineConfig, ServerConfig
    from conveyor.engine.core_client import ThreadCoreClient
    from conveyor.front.llm_engine import LLMEngine
    from conveyor.server.api_server import build_server

    recorder = Recorder()
    threading.setprofile(recorder.hook)
    engine = LLMEngine(EngineConfig.from_options(model=model, threads=threads, kv_cache_memory="64MiB"))
    server = build_server(ThreadCoreClient(engine.core), engine.tokenizer, engine.model_name,
                          ServerConfig(host="127.0.0.1", port=0, core_process=False))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise SystemExit("the server did not start")
        time.sleep(0.01)
    base_url = f"http://127.0.0.1:{server.port}"
    try:
        stream_chat(base_url, engine.model_name, max_tokens)
        wait_until_idle(engine)
        recorder.active = True
        text = stream_chat(base_url, engine.model_name, max_tokens)
        wait_until_idle(engine)
        recorder.active = False
    finally:
        threading.setprofile(None)
        server.should_exit = True
        thread.join(30)
    return recorder, text


def handoff_runs(recorder: Recorder) -> list[tuple[str, str, str]]:
    """The first runs of the functions that pass the request on: those that called another file's code."""
    return [run for run in recorder.first_runs if run[:2] in recorder.hands_on]


def walk_counts(segments: list[Segment]) -> dict[str, int]:
    left = [s for s in segments if s.is_reentry and not s.is_return]
    return {"hops": len(segments), "files": len({s.file for s in segments}),
            "reentries": sum(s.is_reentry for s in segments),
            "files_reentered": len({s.file for s in segments if s.is_reentry}),
            "reentries_after_leaving": len(left), "files_reentered_after_leaving": len({s.file for s in left})}


def describe(segments: list[Segment]) -> str:
    c = walk_counts(segments)
    left = sorted({s.file.removeprefix("conveyor/") for s in segments if s.is_reentry and not s.is_return})
    return (f"{c['hops']} hops through {c['files']} files, {c['reentries']} re-entries into a file already left "
            f"({c['files_reentered']} files); {c['reentries'] - c['reentries_after_leaving']} of them return to a "
            f"file still on the stack, {c['reentries_after_leaving']} come back into one none of whose code was "
            f"running ({c['files_reentered_after_leaving']} files: {', '.join(left)})")


def print_walk(segments: list[Segment]) -> None:
    for i, s in enumerate(segments, 1):
        mark = "returns to" if s.is_return else "re-enters" if s.is_reentry else "enters"
        print(f"{i:3d} {mark:9s} {s.file}: {', '.join(s.functions)}")


def segment_json(s: Segment) -> dict[str, Any]:
    return {"file": s.file, "functions": list(s.functions), "reentry": s.is_reentry, "return": s.is_return}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: the bundled model)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--walk", action="store_true", help="print every segment of the walk")
    p.add_argument("--json", type=Path, default=None, help="write the counts and the walk here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    recorder, text = trace(args.model, args.max_tokens, args.threads)
    segments = walk(recorder.first_runs, on_stack=recorder.on_stack)
    handed_on = handoff_runs(recorder)
    handoffs = walk(handed_on, on_stack=recorder.on_stack)
    floors = walk(recorder.first_runs, by_package=True)
    counts = {**walk_counts(segments), "functions": len(recorder.first_runs), "calls": recorder.num_calls,
              **{f"handoff_{k}": v for k, v in walk_counts(handoffs).items()},
              "handoff_functions": len(handed_on),
              "package_hops": len(floors), "packages": len({s.file for s in floors}),
              "package_reentries": sum(s.is_reentry for s in floors)}
    if args.walk:
        print_walk(segments)
        print("\nthe handoffs alone (functions that call another file's code):")
        print_walk(handoffs)
    print(f"answer: {text!r}")
    print(f"one streamed chat request ({args.max_tokens} tokens), every function: {describe(segments)}; "
          f"{counts['functions']} functions, {counts['calls']} calls in all")
    print(f"its handoffs ({counts['handoff_functions']} functions that call another file's code): "
          f"{describe(handoffs)}")
    print(f"by package: {counts['package_hops']} hops through {counts['packages']} packages, "
          f"{counts['package_reentries']} re-entries: {' -> '.join(s.file.removeprefix('conveyor/') for s in floors)}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "command": " ".join(["python", "scripts/trace_request.py", *(argv or sys.argv[1:])]),
            **counts, "files_walked": sorted({s.file for s in segments}),
            "packages_walked": [s.file for s in floors],
            "walk": [segment_json(s) for s in segments], "handoff_walk": [segment_json(s) for s in handoffs],
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
