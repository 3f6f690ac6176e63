"""`conveyor run-batch`: a file of OpenAI batch requests through the engine, results as they finish.

The lines are OpenAI's batch format (batch_format.py). Each request goes through the same OpenAI
app the server runs (validation, chat templates, structured outputs, errors), called in process
over httpx's ASGI transport, so a batch line and an HTTP request behave alike. Results are written
(and flushed) as each request finishes, in finishing order. A line that is not a valid request gets
one line with its `error` (and the 4xx response, when the API refused it); the rest of the file
still runs. Run again with the same output file, requests whose custom_id is already there are
skipped, so an interrupted batch resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import IO, Any

from conveyor.config import EngineConfig, ServerConfig
from conveyor.server.batch.format import BatchLine, parse_lines, result_line, split_lines

logger = logging.getLogger(__name__)


def done_ids(path: Path) -> set[str]:
    """custom_ids already answered in an output file. A torn last line (a run killed mid-write) is
    cut off, so the results appended next start on a line of their own."""
    ids: set[str] = set()
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
        with path.open(encoding="utf-8") as f:
            for text in f:
                try:
                    ids.add(json.loads(text)["custom_id"])
                except (ValueError, KeyError, TypeError):
                    continue
    return ids


def read_lines(path: Path) -> list[BatchLine]:
    """The file's lines, split at \\n only; a repeated custom_id is that line's error."""
    return parse_lines(split_lines(path.read_bytes()))


async def run_lines(app: Any, lines: list[BatchLine], out: IO[str], concurrency: int, progress: Any) -> dict[str, int]:
    """POST every line to `app`, at most `concurrency` at once, writing each result as it comes."""
    import httpx

    counts = {"completed": 0, "failed": 0}
    limit = asyncio.Semaphore(concurrency)

    def write(text: str, ok: bool) -> None:
        out.write(text)
        out.flush()
        counts["completed" if ok else "failed"] += 1
        progress.update(1)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batch",
                                 timeout=None) as client:
        async def one(line: BatchLine) -> None:
            if line.error is not None:
                write(result_line(line, None, None, line.error), ok=False)
                return
            async with limit:
                response = await client.post(line.url, json=line.body)
            body = response.json()
            write(result_line(line, response.status_code, body, None), ok=response.status_code < 400)

        await asyncio.gather(*(one(line) for line in lines))
    return counts


def run_batch(config: EngineConfig, input_path: Path, output_path: Path, concurrency: int | None = None) -> int:
    """Run the batch; returns 0 when every request succeeded, 1 when some failed."""
    from tqdm import tqdm

    from conveyor.front.async_engine import AsyncEngine
    from conveyor.engine.core_client import ThreadCoreClient
    from conveyor.front.llm_engine import LLMEngine
    from conveyor.server.app import build_app

    skip = done_ids(output_path)
    lines = [line for line in read_lines(input_path) if line.custom_id not in skip]
    if skip:
        logger.warning("resuming: %d requests of %s already answered in %s", len(skip), input_path, output_path)
    if not lines:
        return 0
    engine = LLMEngine(config)
    async_engine = AsyncEngine(ThreadCoreClient(engine.core), engine.tokenizer)
    # No live view and no periodic stats line: nobody watches this app but the progress bar.
    app = build_app(async_engine, engine.model_name, ServerConfig(enable_dashboard=False, stats_log_interval_s=0.0))
    concurrency = concurrency or 2 * config.scheduler.max_num_seqs

    async def main() -> dict[str, int]:
        async with app.router.lifespan_context(app):
            with output_path.open("a", encoding="utf-8") as out, \
                    tqdm(total=len(lines), unit="req", desc="run-batch") as progress:
                return await run_lines(app, lines, out, concurrency, progress)

    counts = asyncio.run(main())
    logger.warning("run-batch: %d completed, %d failed, %d skipped (already in %s)", counts["completed"],
                   counts["failed"], len(skip), output_path)
    return 0 if counts["failed"] == 0 else 1
