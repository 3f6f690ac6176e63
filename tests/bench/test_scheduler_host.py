"""bench.kernels.scheduler_host runs its rows to decode and times both halves of a step."""

from __future__ import annotations

from bench.kernels.scheduler_host import measure


def test_decode_steps_are_timed_after_the_prefill() -> None:
    schedule_ms, update_ms = measure(num_rows=5, context=40, steps=6)
    assert schedule_ms > 0 and update_ms > 0
