"""LiveView: the data of the live batch page (/dashboard), streamed to its viewers as server-sent events.

Owns the viewers and what they are sent. While at least one viewer is connected it asks the core
for a BatchSnapshot at most UPDATE_INTERVAL_S apart (`AsyncEngine.watch_batch`), and keeps from the
core's messages the last steps and a minute of token counts and latencies. Each snapshot becomes
one update, serialized once and queued to every viewer, so the rate of updates is the core's
snapshot rate whatever the step rate. With no viewer, `observe` returns at once and the core takes
no snapshots: an unwatched server computes nothing for the page.

Events (each `data: <json>`): `hello` (configuration and the steps so far) first, then `update`s,
`engine` when the engine core dies; a `: ping` comment every PING_S when nothing else is sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.types import Receive, Scope, Send

from conveyor.core.snapshot import BatchSnapshot, BlockState
from conveyor.front.async_engine import AsyncEngine, EngineDeadError
from conveyor.engine.messages import StepOutputs
from conveyor.errors import ServerBusy

logger = logging.getLogger(__name__)

UPDATE_INTERVAL_S = 0.25      # snapshots per second: a few, enough for the eye
WINDOW_S = 60.0               # throughput and latency percentiles are over this last stretch
MAX_STEPS = 240               # steps of the timeline
MAX_VIEWERS = 32
MAX_QUEUED = 32               # updates a viewer may fall behind before its stream is closed (it reconnects)
PING_S = 5.0
PERCENTILES_EVERY_S = 1.0     # sorting a minute of inter-token gaps 4 times a second would cost the front CPU
_MAX_LATENCY_SAMPLES = 20_000
_PING = b": ping\n\n"
STATIC_DIR = Path(__file__).parent / "static"
EVENTS_PATH = "/dashboard/events"


def add_dashboard(app: FastAPI, engine: AsyncEngine, model_name: str, server: dict[str, Any]) -> LiveView:
    """/ (a redirect), /dashboard (the page), /dashboard/static/* (its files), /dashboard/events (the stream).

    The page and its files hold no data and stay open, as /docs does; the stream goes behind the API
    key (the page asks for it). None of it is in the OpenAPI document: the stream never ends.
    """
    from starlette.staticfiles import StaticFiles

    info = engine.info
    scheduler = {k: v for k, v in dataclasses.asdict(info.scheduler).items() if k != "max_model_len"}
    # The threshold in force (None in the config means "max_num_batched_tokens"), as the start-up log says it.
    scheduler["long_prefill_token_threshold"] = info.scheduler.long_prefill_threshold
    config = {"model": model_name, "weights": info.weights or info.dtype, "compute_dtype": info.dtype,
              "threads": info.num_threads, "max_model_len": info.max_model_len, "num_kv_blocks": info.num_kv_blocks,
              "block_size": info.block_size, "enable_prefix_caching": info.enable_prefix_caching, **scheduler, **server}
    live_view = LiveView(engine, config)
    app.mount("/dashboard/static", StaticFiles(directory=str(STATIC_DIR)), name="dashboard-static")
    no_cache = {"Cache-Control": "no-cache"}

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return RedirectResponse("/dashboard")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return FileResponse(STATIC_DIR / "dashboard.html", headers=no_cache)

    @app.get(EVENTS_PATH, include_in_schema=False)
    async def events() -> Response:
        return EventStream(live_view, live_view.join())

    return live_view


@dataclass(eq=False)
class _Viewer:
    queue: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)


class LiveView:
    """The viewers of one server and the figures they are sent; runs on the event loop only."""

    def __init__(self, engine: AsyncEngine, config: dict[str, Any], clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.config = config
        self.clock = clock
        self.viewers: set[_Viewer] = set()
        self.is_closed = False
        self._started_s = clock()
        self._watched_since_s = self._started_s
        self.steps: deque[list[float]] = deque(maxlen=MAX_STEPS)
        self._new_steps: list[list[float]] = []
        # (time, count) samples of the last WINDOW_S, each appended in time order.
        self._output_tokens: deque[tuple[float, int]] = deque()
        self._prompt_tokens: deque[tuple[float, int]] = deque()
        self._prefix: deque[tuple[float, int, int]] = deque()     # (time, query tokens, hit tokens)
        self._preemptions: deque[tuple[float, int]] = deque()
        self._ttft: deque[tuple[float, float]] = deque(maxlen=_MAX_LATENCY_SAMPLES)
        self._itl: deque[tuple[float, float]] = deque(maxlen=_MAX_LATENCY_SAMPLES)
        self._finished: deque[tuple[float, int]] = deque()
        self._last_token_s: dict[str, float] = {}
        self._latency: tuple[float, dict[str, Any]] = (-PERCENTILES_EVERY_S, {})   # (when, percentiles)
        engine.observers.append(self.observe)
        engine.death_observers.append(self._engine_died)

    # ------------------------------------------------------------ viewers

    def join(self) -> _Viewer:
        if self.is_closed:
            raise EngineDeadError("the server is shutting down")
        if len(self.viewers) >= MAX_VIEWERS:
            raise ServerBusy(f"the live view has {MAX_VIEWERS} viewers, its limit; retry later")
        viewer = _Viewer()
        if not self.viewers:
            self._watched_since_s = self.clock()
            self._clear()
        self.viewers.add(viewer)
        viewer.queue.put_nowait(_event(self._hello()))
        # Every join asks again: the core answers with a snapshot at once, even when idle.
        self.engine.watch_batch(UPDATE_INTERVAL_S)
        return viewer

    def leave(self, viewer: _Viewer) -> None:
        self.viewers.discard(viewer)
        if not self.viewers:
            self.engine.watch_batch(None)
            self._clear()

    def close(self) -> None:
        """End every stream (server shutdown: uvicorn waits for open responses)."""
        self.is_closed = True
        for viewer in list(self.viewers):
            viewer.queue.put_nowait(None)

    def _broadcast(self, payload: dict[str, Any]) -> None:
        data = _event(payload)
        for viewer in list(self.viewers):
            if viewer.queue.qsize() >= MAX_QUEUED:
                logger.info("a live view viewer fell %d updates behind; closing its stream", MAX_QUEUED)
                self.viewers.discard(viewer)
                viewer.queue.put_nowait(None)
            else:
                viewer.queue.put_nowait(data)

    def _clear(self) -> None:
        for samples in (self._output_tokens, self._prompt_tokens, self._prefix, self._preemptions, self._ttft,
                        self._itl, self._finished):
            samples.clear()
        self.steps.clear()
        self._latency = (-PERCENTILES_EVERY_S, {})
        self._new_steps.clear()
        self._last_token_s.clear()

    # ------------------------------------------------------------ from the core (event loop)

    def observe(self, outputs: StepOutputs) -> None:
        if not self.viewers:
            return
        now = self.clock()
        step = outputs.step
        if step is not None:
            self._new_steps.append([round(now - self._started_s, 3), step.num_prefill_tokens, step.num_decode_tokens,
                                    step.num_rows, round(step.step_time_s * 1e3, 2), step.num_preemptions])
            self._prompt_tokens.append((now, step.num_prefill_tokens))
            if step.num_prefix_query_tokens:
                self._prefix.append((now, step.num_prefix_query_tokens, step.num_prefix_hit_tokens))
            if step.num_preemptions:
                self._preemptions.append((now, step.num_preemptions))
        num_output = 0
        for delta in outputs.deltas:
            if delta.new_token_ids:
                num_output += len(delta.new_token_ids)
                last_s = self._last_token_s.get(delta.request_id)
                if last_s is not None:
                    self._itl.append((now, (now - last_s) / len(delta.new_token_ids)))
                self._last_token_s[delta.request_id] = now
            if delta.finished:
                self._last_token_s.pop(delta.request_id, None)
                self._finished.append((now, 1))
                if delta.metrics is not None and delta.metrics.ttft_s is not None:
                    self._ttft.append((now, delta.metrics.ttft_s))
        if num_output:
            self._output_tokens.append((now, num_output))
        if outputs.snapshot is not None:
            self._broadcast(self._update(outputs.snapshot, now))
            # Aborted requests send no finished delta: forget them once they outnumber the live ones.
            if len(self._last_token_s) > outputs.snapshot.num_running + outputs.snapshot.num_waiting:
                for request_id in [r for r in self._last_token_s if r not in self.engine.processor]:
                    del self._last_token_s[request_id]

    def _engine_died(self, reason: str) -> None:
        self._broadcast({"type": "engine", "status": "down", "reason": reason})

    # ------------------------------------------------------------ payloads

    def _hello(self) -> dict[str, Any]:
        dead = self.engine.dead_reason
        return {"type": "hello", "config": self.config, "update_interval_s": UPDATE_INTERVAL_S,
                "window_s": WINDOW_S, "steps": list(self.steps),
                "engine": {"status": "down", "reason": dead} if dead is not None else {"status": "up"}}

    def _update(self, snapshot: BatchSnapshot, now: float) -> dict[str, Any]:
        self.steps.extend(self._new_steps)
        new_steps, self._new_steps = self._new_steps, []
        horizon = now - WINDOW_S
        for samples in (self._output_tokens, self._prompt_tokens, self._prefix, self._preemptions, self._ttft,
                        self._itl, self._finished):
            while samples and samples[0][0] < horizon:
                samples.popleft()
        seconds = max(min(WINDOW_S, now - self._watched_since_s), 1e-3)
        if now - self._latency[0] >= PERCENTILES_EVERY_S or not snapshot.rows:
            self._latency = (now, {"ttft_ms": _percentiles([s[1] for s in self._ttft]),
                                   "itl_ms": _percentiles([s[1] for s in self._itl])})
        query = sum(s[1] for s in self._prefix)
        hits = sum(s[2] for s in self._prefix)
        states = snapshot.block_states
        block_counts = {state.name.lower(): states.count(state) for state in BlockState}
        num_in_use = block_counts["in_use"] + block_counts["in_use_cached"]
        rows = []
        for row in snapshot.rows:
            since_first = snapshot.time_s - row.first_token_s if row.first_token_s is not None else 0.0
            rate = (row.num_output_tokens - 1) / since_first if row.num_output_tokens > 1 and since_first > 0 else None
            rows.append({"id": row.request_id, "state": row.state.value, "prompt": row.num_computed_prompt_tokens,
                         "prompt_total": row.num_prompt_tokens, "cached": row.num_cached_tokens,
                         "output": row.num_output_tokens, "max_tokens": row.max_tokens,
                         "tokens_per_s": None if rate is None else round(rate, 1), "priority": row.priority,
                         "tenant": row.tenant, "age_s": round(snapshot.time_s - row.arrival_s, 2),
                         "preemptions": row.num_preemptions, "blocks": row.num_blocks,
                         "step_tokens": row.num_step_tokens, "wait_cause": row.wait_cause})
        return {
            "type": "update", "time_s": round(now - self._started_s, 3), "accepting": self.engine.is_accepting,
            "num_running": snapshot.num_running, "num_waiting": snapshot.num_waiting, "rows": rows,
            "blocks": states.translate(_DIGITS).decode(), "block_counts": block_counts,
            "steps": new_steps,
            "stats": {
                "window_s": round(seconds, 1),
                "output_tokens_per_s": round(sum(s[1] for s in self._output_tokens) / seconds, 1),
                "prompt_tokens_per_s": round(sum(s[1] for s in self._prompt_tokens) / seconds, 1),
                "requests_per_s": round(len(self._finished) / seconds, 2),
                "preemptions": sum(s[1] for s in self._preemptions),
                **self._latency[1],
                "prefix_hit_rate": hits / query if query else None,
                "prefix_hit_rate_total": (snapshot.num_prefix_hit_tokens / snapshot.num_prefix_query_tokens
                                          if snapshot.num_prefix_query_tokens else None),
                "kv_usage": num_in_use / len(states) if states else 0.0,
            },
        }


# Block states travel as one digit per block ("0" free, "1" in use, "2" cached, "3" in use and cached).
_DIGITS = bytes.maketrans(bytes(range(len(BlockState))), "".join(str(s.value) for s in BlockState).encode())


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    values.sort()
    last = len(values) - 1
    return {f"p{p}": round(values[min(last, round(p / 100 * last))] * 1e3, 1) for p in (50, 90, 99)}


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class EventStream(Response):
    """The response of one viewer: its events until it leaves, the view closes, or it lags.

    A disconnect is watched for on `receive` (the body of a GET is already read), so a viewer that
    closes its tab leaves at once rather than at the next failed send.
    """

    def __init__(self, live_view: LiveView, viewer: _Viewer) -> None:   # no body, no Content-Length
        self.live_view = live_view
        self.viewer = viewer
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        queue = self.viewer.queue

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            queue.put_nowait(None)

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            while True:
                try:
                    async with asyncio.timeout(PING_S):
                        item = await queue.get()
                except TimeoutError:
                    item = _PING
                if item is None:
                    break
                await send({"type": "http.response.body", "body": item, "more_body": True})
            if not watcher.done():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass   # the client went away mid-send
        finally:
            watcher.cancel()
            self.live_view.leave(self.viewer)
