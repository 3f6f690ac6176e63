"""The state of OpenAI Files and Batches, in an embedded SQLite database that survives a restart.

One database file under --state-dir (in memory without it). A batch's lines are rows: a line is
pending until its result is committed, so a server killed mid-batch loses only the lines that
were in flight, and those run again after the restart; a committed line never runs twice. Used
from the event loop's thread only: every call is a few small statements.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.server.batch_format import BATCH_URLS, parse_line, result_line

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, created_at INTEGER NOT NULL,
    content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, metadata TEXT, output_file_id TEXT, error_file_id TEXT, created_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, cancelling_at INTEGER,
    cancelled_at INTEGER);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, number INTEGER NOT NULL, custom_id TEXT NOT NULL, url TEXT, body TEXT,
    done INTEGER NOT NULL DEFAULT 0, ok INTEGER, result TEXT, PRIMARY KEY (batch_id, number));
"""
ACTIVE = ("validating", "in_progress", "cancelling")


@dataclass(slots=True)
class PendingLine:
    number: int
    custom_id: str
    url: str
    body: dict[str, Any]


class BatchStore:
    def __init__(self, state_dir: Path | None) -> None:
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
        path = ":memory:" if state_dir is None else str(state_dir / "batches.sqlite3")
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(_SCHEMA)

    # ------------------------------------------------------------ files

    def add_file(self, filename: str, purpose: str, content: bytes) -> dict[str, Any]:
        file_id = f"file-{uuid.uuid4().hex}"
        self.db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?)", (file_id, purpose, filename, int(time.time()),
                                                                     content))
        return self.file(file_id)   # type: ignore[return-value]

    def file(self, file_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT id, purpose, filename, created_at, length(content) AS bytes FROM files "
                              "WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            return None
        return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
                "filename": row["filename"], "purpose": row["purpose"], "status": "processed"}

    def files(self) -> list[dict[str, Any]]:
        ids = [row[0] for row in self.db.execute("SELECT id FROM files ORDER BY created_at, rowid")]
        return [self.file(file_id) for file_id in ids]   # type: ignore[misc]

    def file_content(self, file_id: str) -> bytes | None:
        row = self.db.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else bytes(row[0])

    # ------------------------------------------------------------ batches

    def add_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                  metadata: dict[str, str] | None) -> dict[str, Any]:
        """Split the input file into lines (bad ones are answered at once with their error)."""
        content = self.file_content(input_file_id) or b""
        batch_id = f"batch_{uuid.uuid4().hex}"
        rows = []
        for number, text in enumerate(content.decode("utf-8", errors="replace").splitlines(), start=1):
            if not text.strip():
                continue
            line = parse_line(number, text)
            if line.error is None and line.url != endpoint:
                line.error = f"the line's url {line.url} is not the batch's endpoint {endpoint}"
            if line.error is not None:
                rows.append((batch_id, number, line.custom_id, None, None, 1, 0,
                             result_line(line, None, None, line.error)))
            else:
                rows.append((batch_id, number, line.custom_id, line.url, json.dumps(line.body), 0, None, None))
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("INSERT INTO batches (id, input_file_id, endpoint, completion_window, status, metadata, "
                            "created_at) VALUES (?, ?, ?, ?, 'validating', ?, ?)",
                            (batch_id, input_file_id, endpoint, completion_window,
                             json.dumps(metadata) if metadata else None, int(time.time())))
            self.db.executemany("INSERT INTO lines VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        return self.batch(batch_id)   # type: ignore[return-value]

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            return None
        total, done, ok = self.db.execute("SELECT count(*), coalesce(sum(done), 0), coalesce(sum(ok), 0) "
                                          "FROM lines WHERE batch_id = ?", (batch_id,)).fetchone()
        batch = {key: row[key] for key in row.keys() if key != "metadata"}
        batch.update(object="batch", errors=None, metadata=json.loads(row["metadata"]) if row["metadata"] else None,
                     expires_at=None, failed_at=None, expired_at=None,
                     request_counts={"total": total, "completed": ok, "failed": done - ok})
        return batch

    def batches(self) -> list[dict[str, Any]]:
        ids = [row[0] for row in self.db.execute("SELECT id FROM batches ORDER BY created_at, rowid")]
        return [self.batch(batch_id) for batch_id in ids]   # type: ignore[misc]

    def status(self, batch_id: str) -> str | None:
        row = self.db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else row[0]

    def next_active(self) -> dict[str, Any] | None:
        row = self.db.execute(f"SELECT id FROM batches WHERE status IN {ACTIVE} ORDER BY created_at, rowid "
                              "LIMIT 1").fetchone()
        return None if row is None else self.batch(row[0])

    def set_status(self, batch_id: str, status: str) -> None:
        stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
                 "cancelling": "cancelling_at", "cancelled": "cancelled_at"}.get(status)
        sql = "UPDATE batches SET status = ?" + (f", {stamp} = coalesce({stamp}, ?)" if stamp else "") + " WHERE id = ?"
        self.db.execute(sql, (status, int(time.time()), batch_id) if stamp else (status, batch_id))

    def pending(self, batch_id: str) -> list[PendingLine]:
        rows = self.db.execute("SELECT number, custom_id, url, body FROM lines WHERE batch_id = ? AND done = 0 "
                               "ORDER BY number", (batch_id,))
        return [PendingLine(row[0], row[1], row[2], json.loads(row[3])) for row in rows]

    def finish_line(self, batch_id: str, number: int, ok: bool, result: str) -> None:
        self.db.execute("UPDATE lines SET done = 1, ok = ?, result = ? WHERE batch_id = ? AND number = ? AND done = 0",
                        (int(ok), result, batch_id, number))

    def finalize(self, batch_id: str, status: str) -> None:
        """Write the output file (lines that succeeded) and the error file (the rest), in line order."""
        output, errors = [], []
        for ok, result in self.db.execute("SELECT ok, result FROM lines WHERE batch_id = ? AND done = 1 "
                                          "ORDER BY number", (batch_id,)):
            (output if ok else errors).append(result)
        with self.db:
            self.db.execute("BEGIN")
            for column, results in (("output_file_id", output), ("error_file_id", errors)):
                if results:
                    file_id = f"file-{uuid.uuid4().hex}"
                    self.db.execute("INSERT INTO files VALUES (?, 'batch_output', ?, ?, ?)",
                                    (file_id, f"{batch_id}_{column.split('_')[0]}.jsonl", int(time.time()),
                                     "".join(results).encode("utf-8")))
                    self.db.execute(f"UPDATE batches SET {column} = ? WHERE id = ?", (file_id, batch_id))
        self.set_status(batch_id, status)

    @staticmethod
    def endpoints() -> tuple[str, ...]:
        return BATCH_URLS
