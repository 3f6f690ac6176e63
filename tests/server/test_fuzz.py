"""Schemathesis against the app's own OpenAPI document: no 5xx, responses match their schemas, and
data that violates the schema is refused with a 4xx. Seeded and bounded for CI; the `slow`
variant runs ten times the examples, and `python -m bench fuzz` runs as many as asked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import negative_data_rejection, response_schema_conformance  # noqa: E402
from server_helpers import RunningServer, start_server  # noqa: E402

CHECKS = [not_a_server_error, response_schema_conformance, negative_data_rejection]
NUM_EXAMPLES = 100   # per operation and mode


@pytest.fixture(scope="module")
def fuzz_server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    # A short model length keeps every accepted request a few dozen tokens at most.
    running = start_server(tiny_checkpoint, max_num_seqs=8, max_model_len=48)
    yield running
    running.stop()


def fuzz(base_url: str, num_examples: int) -> list[str]:
    """Run every operation of the document in both modes; returns the operations and modes run."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    runs = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and not operation.body:
                continue  # no body: its only parameters are free-form path strings, which nothing violates
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=num_examples, derandomize=True, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case) -> None:  # type: ignore[no-untyped-def]
                case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=60)

            run()
            runs.append(f"{operation.label} {mode.value}")
    return runs


def test_api_conforms_and_never_fails(fuzz_server: RunningServer) -> None:
    runs = fuzz(fuzz_server.base_url, NUM_EXAMPLES)
    assert "POST /v1/completions negative" in runs and "POST /v1/chat/completions positive" in runs
    engine = fuzz_server.engine
    assert not engine.has_unfinished_requests() and engine.blocks.num_used_blocks == 0


@pytest.mark.slow
def test_api_conforms_and_never_fails_long(fuzz_server: RunningServer) -> None:
    fuzz(fuzz_server.base_url, 10 * NUM_EXAMPLES)
