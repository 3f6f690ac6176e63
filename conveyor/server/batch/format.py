"""OpenAI's batch file format, the lines `vllm run-batch` reads and writes; `conveyor run-batch` and the
Batches API (batch_store.py, batch_api.py) both read requests and write results in it.

An input line:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

An output line:

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": ..., "body": {...}},
     "error": null}
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

BATCH_URLS = ("/v1/chat/completions", "/v1/completions")


@dataclass(slots=True)
class BatchLine:
    number: int                      # 1-based line number in the input file
    custom_id: str
    url: str | None = None
    body: dict[str, Any] | None = None
    error: str | None = None         # why the line is not a request
    duplicate_of: int | None = None  # the earlier line with the same custom_id


def split_lines(content: bytes) -> Iterator[tuple[int, str | None]]:
    """(1-based number, text) of each non-blank line; text None for a line that is not UTF-8.

    Lines end at \\n only: U+2028, U+0085 and a lone \\r are legal inside a JSON string, and
    str.splitlines would cut a request in two there."""
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if raw.strip():
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield number, None


def parse_lines(numbered: Iterable[tuple[int, str | None]]) -> list[BatchLine]:
    """Every line parsed; a custom_id seen before makes that line an error (OpenAI requires them unique)."""
    lines: list[BatchLine] = []
    first_of: dict[str, int] = {}
    for number, text in numbered:
        line = (parse_line(number, text) if text is not None
                else BatchLine(number, f"line-{number}", error=f"line {number} is not valid UTF-8"))
        if line.error is None:
            first = first_of.setdefault(line.custom_id, number)
            if first != number:
                line.duplicate_of = first
                line.error = f"custom_id {line.custom_id!r} is already used by line {first}; custom_ids must be unique"
        lines.append(line)
    return lines


def parse_line(number: int, text: str) -> BatchLine:
    try:
        line = json.loads(text)
    except ValueError as exc:
        return BatchLine(number, f"line-{number}", error=f"line {number} is not valid JSON: {exc}")
    except RecursionError:
        return BatchLine(number, f"line-{number}", error=f"line {number} is nested too deeply to parse")
    if not isinstance(line, dict):
        return BatchLine(number, f"line-{number}", error=f"line {number} is not a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(number, f"line-{number}", error=f"line {number} has no custom_id string")
    if line.get("method", "POST") != "POST":
        return BatchLine(number, custom_id, error=f"method must be POST, got {line.get('method')!r}")
    url, body = line.get("url"), line.get("body")
    if url not in BATCH_URLS:
        return BatchLine(number, custom_id, error=f"url must be one of {', '.join(BATCH_URLS)}, got {url!r}")
    if not isinstance(body, dict):
        return BatchLine(number, custom_id, error="body must be a JSON object")
    if body.get("stream"):
        return BatchLine(number, custom_id, error="stream is not supported in a batch")
    return BatchLine(number, custom_id, url, body)


def result_line(line: BatchLine, status: int | None, body: Any, error: str | None) -> str:
    response = None if status is None else {"status_code": status, "request_id": f"req-{uuid.uuid4().hex}",
                                            "body": body}
    if error is None and status is not None and status >= 400:
        error = (body.get("error") or {}).get("message") if isinstance(body, dict) else str(body)
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": response,
                       "error": None if error is None else {"code": str(status or "invalid_line"),
                                                            "message": error}}, ensure_ascii=False) + "\n"
