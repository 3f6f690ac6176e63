"""Server fixtures: real uvicorn servers in background threads on free loopback ports (server_helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from server_helpers import API_KEY, RunningServer, start_server  # noqa: E402


@pytest.fixture(scope="session")
def tiny_server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    """The shared tiny-model server: no key, four sequences per batch, a 1 MiB body limit."""
    running = start_server(tiny_checkpoint, max_num_seqs=4)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def keyed_server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, api_key=API_KEY, max_num_seqs=2)
    yield running
    running.stop()
