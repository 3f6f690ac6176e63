"""The live view's event stream on a real server (httpx): what it sends, to whom, and at what cost.

The page itself is tested in a browser in test_live_view_browser.py.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import API_KEY, RunningServer, launch_server_process, slow_steps, start_server, wait_for

from conveyor.core.snapshot import BlockState
from conveyor.server import live_view
from conveyor.server.live_view import UPDATE_INTERVAL_S

EVENTS = "/dashboard/events"


@pytest.fixture(autouse=True)
def frequent_pings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader thread notices it was closed at the next line: pings make that quick."""
    monkeypatch.setattr(live_view, "PING_S", 0.2)


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, max_num_seqs=4)
    yield running
    running.stop()


class Viewer:
    """One event stream read on a thread: its JSON events, in order."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        self.events: list[dict[str, Any]] = []
        self.status: int | None = None
        self.ended = threading.Event()
        self._closing = False
        self.error: BaseException | None = None
        self._client = httpx.Client(base_url=base_url, timeout=httpx.Timeout(30, read=30), headers=headers)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        wait_for(lambda: self.events or self.ended.is_set(), 10, "the stream's first event")

    def _read(self) -> None:
        try:
            with self._client.stream("GET", EVENTS) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if self._closing:
                        return   # leaving the block closes the connection: the server sees the disconnect
                    if line.startswith("data: "):
                        self.events.append(json.loads(line[len("data: "):]))
        except BaseException as exc:
            self.error = exc
        finally:
            self.ended.set()

    def updates(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == "update"]

    def close(self) -> None:
        self._closing = True
        assert self.ended.wait(10), "the viewer's thread did not end"
        self._client.close()


def generate(base_url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", json={"prompt": "hello there", "max_tokens": 8,
                                                          "ignore_eos": True, **body}, timeout=60)


def in_background(fn: Any, *args: Any, **kwargs: Any) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, kwargs=kwargs, daemon=True)
    thread.start()
    return thread


def test_a_request_joins_the_rows_and_leaves_them_and_the_block_map_follows(server: RunningServer) -> None:
    viewer = Viewer(server.base_url)
    try:
        hello = viewer.events[0]
        assert hello["type"] == "hello" and hello["engine"] == {"status": "up"}
        config = hello["config"]
        assert config["model"] == server.model_name and config["max_num_seqs"] == 4
        assert config["num_kv_blocks"] == server.engine.core.info.num_kv_blocks
        # The values in force, as the start-up log says them: the threshold resolved, the weights' own format.
        assert config["long_prefill_token_threshold"] == server.engine.core.info.scheduler.long_prefill_threshold
        assert config["weights"] == server.engine.core.info.weights == config["compute_dtype"]   # a float folder
        wait_for(lambda: viewer.updates(), 10, "the first update (sent at once, even idle)")
        assert viewer.updates()[0]["rows"] == []
        with slow_steps(server.engine, 0.02):
            request = in_background(generate, server.base_url, user="live-tenant", max_tokens=24)
            wait_for(lambda: any(r["tenant"] == "live-tenant" and r["state"] == "decoding"
                                 for u in viewer.updates() for r in u["rows"]), 20, "the request's row")
            request.join(60)
        wait_for(lambda: viewer.updates()[-1]["rows"] == [], 10, "the row to leave")
        updates = viewer.updates()
        busy = next(u for u in updates if u["rows"])
        row = busy["rows"][0]
        assert row["prompt_total"] > 0 and row["max_tokens"] == 24 and row["priority"] == 0
        # A running row shows the tokens the last step computed for it, and no wait cause.
        decoding = [r for u in updates for r in u["rows"] if r["state"] == "decoding"]
        assert decoding and all(r["step_tokens"] >= 1 and r["wait_cause"] is None for r in decoding)
        assert busy["num_running"] == 1 and busy["stats"]["kv_usage"] > 0
        assert set(busy["blocks"]) <= {str(s.value) for s in BlockState}
        assert str(BlockState.IN_USE.value) in busy["blocks"] or str(BlockState.IN_USE_CACHED.value) in busy["blocks"]
        last = updates[-1]
        assert "1" not in last["blocks"] and "3" not in last["blocks"] and last["stats"]["kv_usage"] == 0
        assert last["stats"]["ttft_ms"]["p50"] > 0 and last["stats"]["itl_ms"]["p99"] > 0
        steps = [s for u in updates for s in u["steps"]]
        assert len(steps) >= 24 and sum(s[2] for s in steps) >= 23 and sum(s[1] for s in steps) > 0
        # Throttled: ~25 steps of at least 20 ms made at most a few updates a second, not one per step.
        seconds = steps[-1][0] - steps[0][0]
        assert len(updates) <= seconds / UPDATE_INTERVAL_S + 4
    finally:
        viewer.close()


def test_nothing_is_computed_while_nobody_watches(server: RunningServer) -> None:
    core = server.engine.core
    snapshots: list[bool] = []
    server.server.async_engine.observers.append(lambda outputs: snapshots.append(outputs.snapshot is not None))
    try:
        wait_for(lambda: core.snapshots.interval_s is None, 10, "no viewer left from another test")
        assert generate(server.base_url).status_code == 200
        assert snapshots and not any(snapshots)
        viewer = Viewer(server.base_url)
        wait_for(lambda: core.snapshots.interval_s == UPDATE_INTERVAL_S, 10, "the core to be asked for snapshots")
        viewer.close()
        wait_for(lambda: core.snapshots.interval_s is None, 10, "the core to stop taking snapshots")
        snapshots.clear()
        assert generate(server.base_url).status_code == 200
        assert snapshots and not any(snapshots)
    finally:
        server.server.async_engine.observers.pop()


def test_several_viewers_get_the_same_updates_and_one_leaving_keeps_the_other(server: RunningServer) -> None:
    first, second = Viewer(server.base_url), Viewer(server.base_url)
    try:
        wait_for(lambda: first.updates() and second.updates(), 10, "both viewers' first update")
        assert first.updates()[-1] == second.updates()[-1]   # one payload, serialized once for all
        first.close()
        with slow_steps(server.engine, 0.02):
            assert generate(server.base_url, user="after-first-left", max_tokens=24).status_code == 200
        wait_for(lambda: any(r["tenant"] == "after-first-left" for u in second.updates() for r in u["rows"]),
                 10, "the second viewer to see the request")
        assert server.engine.core.snapshots.interval_s == UPDATE_INTERVAL_S
    finally:
        first.close()
        second.close()


def test_the_page_and_its_files_are_served_without_any_outside_address(server: RunningServer) -> None:
    assert httpx.get(f"{server.base_url}/").headers.get("location") == "/dashboard"
    page = httpx.get(f"{server.base_url}/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in ("dashboard.js", "dashboard.css"):
        asset = httpx.get(f"{server.base_url}/dashboard/static/{name}", timeout=10)
        assert asset.status_code == 200 and len(asset.text) > 1000, name
        assert "http://" not in asset.text and "https://" not in asset.text, name
    assert "http" not in page.text.replace("http-equiv", "")
    assert EVENTS not in httpx.get(f"{server.base_url}/openapi.json", timeout=10).text   # it never ends: not for fuzzers


def test_the_stream_needs_the_api_key_and_the_page_does_not(tiny_checkpoint: Path) -> None:
    running = start_server(tiny_checkpoint, api_key=API_KEY, max_num_seqs=2)
    try:
        base = running.base_url
        refused = httpx.get(f"{base}{EVENTS}", timeout=10)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{base}{EVENTS}", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
        assert httpx.get(f"{base}/dashboard", timeout=10).status_code == 200
        viewer = Viewer(base, headers={"Authorization": f"Bearer {API_KEY}"})
        assert viewer.status == 200 and viewer.events[0]["config"]["api_key_required"] is True
        viewer.close()
    finally:
        running.stop()


def test_no_dashboard_removes_the_page_and_the_stream(tiny_checkpoint: Path) -> None:
    running = start_server(tiny_checkpoint, max_num_seqs=2, server_options={"enable_dashboard": False})
    try:
        for path in ("/", "/dashboard", EVENTS, "/dashboard/static/dashboard.js"):
            assert httpx.get(f"{running.base_url}{path}", timeout=10).status_code == 404, path
    finally:
        running.stop()


def test_a_server_with_a_viewer_stops_promptly_and_ends_the_stream(tiny_checkpoint: Path) -> None:
    running = start_server(tiny_checkpoint, max_num_seqs=2)
    viewer = Viewer(running.base_url)
    started = time.monotonic()
    running.stop(timeout_s=10)
    assert time.monotonic() - started < 4
    assert viewer.ended.wait(5) and viewer.error is None   # a clean end of the body, not a broken connection
    viewer.close()


def test_viewers_are_told_when_the_engine_core_dies(tiny_checkpoint: Path) -> None:
    running = start_server(tiny_checkpoint, max_num_seqs=2)
    try:
        viewer = Viewer(running.base_url)
        wait_for(lambda: viewer.updates(), 10, "the first update")

        def crash(*args: Any) -> Any:
            raise SystemExit("simulated core crash")

        running.engine.core.step_or_fail = crash   # the busy loop dies: the thread client reports the death
        generate(running.base_url)
        wait_for(lambda: any(e["type"] == "engine" for e in viewer.events), 10, "the engine event")
        event = next(e for e in viewer.events if e["type"] == "engine")
        assert event["status"] == "down" and "engine core failed" in event["reason"]
        assert viewer.ended.wait(10)   # the server exits a second later, ending the stream
    finally:
        running.thread.join(15)


def test_the_core_in_its_own_process_sends_snapshots_and_sigterm_ends_the_stream(tiny_checkpoint: Path) -> None:
    """`conveyor serve` as run: the watch command and the snapshots cross the pipe; SIGTERM with a
    viewer connected exits 0 promptly (uvicorn would otherwise wait for the never-ending stream)."""
    process, base = launch_server_process(tiny_checkpoint, "--max-num-seqs", "2")
    try:
        viewer = Viewer(base)
        wait_for(lambda: viewer.updates(), 10, "the first update, from the core process")
        assert generate(base, user="process-core", max_tokens=64).status_code == 200
        wait_for(lambda: viewer.updates()[-1]["rows"] == [] and len(viewer.updates()) > 1, 10, "the idle update")
        assert sum(s[2] for u in viewer.updates() for s in u["steps"]) >= 63
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
        assert time.monotonic() - started < 5
        assert viewer.ended.wait(5) and viewer.error is None
        viewer.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
