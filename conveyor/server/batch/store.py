"""The state of OpenAI Files and Batches, in an embedded SQLite database that survives a restart.

One database file under --state-dir (in memory without it). A batch's lines are rows: a line is
pending until its result is committed, so a server killed mid-batch loses only the lines that
were in flight, and those run again after the restart; a committed line never runs twice.

Files and batches belong to the tenant that made them (the X-Tenant header; "" without one), and
another tenant's ids are unknown to it. Every call takes the store's lock; the heavy ones (splitting
an input file, reading a batch's pending lines, writing its output) run on a worker thread and
hold the lock only for short statements, so the event loop never waits long on it. A write the
disk refuses (full, read-only, failing) raises StorageFull; a batch that cannot even be marked
failed on disk is failed in memory, so the runner moves on.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.errors import InvalidRequest, StorageFull
from conveyor.server.batch.format import BATCH_URLS, parse_lines, result_line, split_lines

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
# Columns added since the first schema; a database from before gets them on open.
_ADDED = (("files", "tenant", "TEXT NOT NULL DEFAULT ''"), ("batches", "tenant", "TEXT NOT NULL DEFAULT ''"),
          ("batches", "failed_at", "INTEGER"), ("batches", "errors", "TEXT"))
_FILE_COLUMNS = "id, purpose, filename, created_at, length(content) AS bytes"
ACTIVE = ("validating", "in_progress", "cancelling")
_STORAGE_CODES = {8, 10, 13, 14}   # SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN
_ROWS_PER_WRITE = 2000             # lines inserted per statement batch, so the lock is never held long

Write = tuple[str, Any]            # (sql, parameters); a list of parameter tuples runs executemany


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
        for table, column, kind in _ADDED:
            if column not in {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self._lock = threading.RLock()
        self._failed_in_memory: dict[str, str] = {}   # batch id -> error, where the disk refused the update

    # ------------------------------------------------------------ plumbing

    def _write(self, statements: list[Write], what: str) -> None:
        """Run `statements` in one transaction; StorageFull when the disk refuses them."""
        with self._storage_errors(what), self._lock, self.db:
            self.db.execute("BEGIN")
            for sql, params in statements:
                if isinstance(params, list):
                    self.db.executemany(sql, params)
                else:
                    self.db.execute(sql, params)

    @contextmanager
    def _storage_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except (sqlite3.OperationalError, OSError) as exc:
            code = getattr(exc, "sqlite_errorcode", None)
            if isinstance(exc, sqlite3.OperationalError) and (code is None or code & 0xFF not in _STORAGE_CODES):
                raise
            raise StorageFull(f"the server could not store {what}: {exc}; free space under its --state-dir "
                              f"and retry") from exc

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self.db.execute(sql, params).fetchall()

    @staticmethod
    def _scope(tenant: str | None) -> tuple[str, tuple[Any, ...]]:
        """The SQL condition and parameters that keep a tenant to its own rows (None: every row)."""
        return ("", ()) if tenant is None else (" AND tenant = ?", (tenant,))

    # ------------------------------------------------------------ files

    def add_file(self, filename: str, purpose: str, content: bytes, tenant: str = "") -> dict[str, Any]:
        file_id = f"file-{uuid.uuid4().hex}"
        self._write([("INSERT INTO files (id, purpose, filename, created_at, content, tenant) "
                      "VALUES (?, ?, ?, ?, ?, ?)", (file_id, purpose, filename, int(time.time()), content, tenant))],
                    "the file")
        return self.file(file_id)   # type: ignore[return-value]

    def file(self, file_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        where, params = self._scope(tenant)
        rows = self._read(f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ?{where}", (file_id, *params))
        return _file_object(rows[0]) if rows else None

    def files(self, tenant: str | None = None) -> list[dict[str, Any]]:
        where, params = self._scope(tenant)
        return [_file_object(row) for row in self._read(f"SELECT {_FILE_COLUMNS} FROM files WHERE 1{where} "
                                                          "ORDER BY created_at, rowid", params)]

    def file_content(self, file_id: str, tenant: str | None = None) -> bytes | None:
        where, params = self._scope(tenant)
        rows = self._read(f"SELECT content FROM files WHERE id = ?{where}", (file_id, *params))
        return bytes(rows[0][0]) if rows else None

    # ------------------------------------------------------------ batches

    def add_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                  metadata: dict[str, str] | None, tenant: str = "") -> dict[str, Any]:
        """Split the input file into lines (bad ones are answered at once with their error). Blocks for
        as long as parsing the file takes: call it on a worker thread. InvalidRequest for repeated custom_ids."""
        content = self.file_content(input_file_id, tenant) or b""
        lines = parse_lines(split_lines(content))
        repeated = [line for line in lines if line.duplicate_of is not None]
        if repeated:
            first = repeated[0]
            raise InvalidRequest(f"the input file repeats custom_ids ({len(repeated)} lines; line {first.number} "
                                 f"repeats {first.custom_id!r} of line {first.duplicate_of}): each request's "
                                 f"custom_id must be unique within a batch", param="input_file_id",
                                 code="duplicate_custom_id")
        batch_id = f"batch_{uuid.uuid4().hex}"
        rows = []
        for line in lines:
            if line.error is None and line.url != endpoint:
                line.error = f"the line's url {line.url} is not the batch's endpoint {endpoint}"
            if line.error is not None:
                rows.append((batch_id, line.number, line.custom_id, None, None, 1, 0,
                             result_line(line, None, None, line.error)))
            else:
                rows.append((batch_id, line.number, line.custom_id, line.url, json.dumps(line.body), 0, None, None))
        # Lines first, in short transactions: no query finds them until the batch row exists.
        try:
            for start in range(0, len(rows), _ROWS_PER_WRITE):
                self._write([("INSERT INTO lines VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                              rows[start:start + _ROWS_PER_WRITE])], "the batch's lines")
            self._write([("INSERT INTO batches (id, input_file_id, endpoint, completion_window, status, metadata, "
                          "created_at, tenant) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?)",
                          (batch_id, input_file_id, endpoint, completion_window,
                           json.dumps(metadata) if metadata else None, int(time.time()), tenant))], "the batch")
        except StorageFull:
            with self._storage_errors("the batch"), self._lock:   # best effort: free what was written
                self.db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            raise
        return self.batch(batch_id)   # type: ignore[return-value]

    def batch(self, batch_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        where, params = self._scope(tenant)
        with self._lock:
            row = self.db.execute(f"SELECT * FROM batches WHERE id = ?{where}", (batch_id, *params)).fetchone()
            if row is None:
                return None
            total, done, ok = self.db.execute("SELECT count(*), coalesce(sum(done), 0), coalesce(sum(ok), 0) "
                                              "FROM lines WHERE batch_id = ?", (batch_id,)).fetchone()
        batch = {key: row[key] for key in row.keys() if key not in ("metadata", "errors", "tenant")}
        errors = json.loads(row["errors"]) if row["errors"] else None
        if batch_id in self._failed_in_memory:
            batch.update(status="failed", failed_at=batch["failed_at"] or int(time.time()))
            errors = _errors(self._failed_in_memory[batch_id])
        batch.update(object="batch", errors=errors, metadata=json.loads(row["metadata"]) if row["metadata"] else None,
                     expires_at=None, expired_at=None,
                     request_counts={"total": total, "completed": ok, "failed": done - ok})
        return batch

    def batches(self, tenant: str | None = None) -> list[dict[str, Any]]:
        where, params = self._scope(tenant)
        ids = [row[0] for row in self._read(f"SELECT id FROM batches WHERE 1{where} ORDER BY created_at, rowid",
                                            params)]
        return [self.batch(batch_id) for batch_id in ids]   # type: ignore[misc]

    def status(self, batch_id: str) -> str | None:
        if batch_id in self._failed_in_memory:
            return "failed"
        rows = self._read("SELECT status FROM batches WHERE id = ?", (batch_id,))
        return rows[0][0] if rows else None

    def tenant(self, batch_id: str) -> str:
        rows = self._read("SELECT tenant FROM batches WHERE id = ?", (batch_id,))
        return rows[0][0] if rows else ""

    def next_active(self) -> dict[str, Any] | None:
        for row in self._read(f"SELECT id FROM batches WHERE status IN {ACTIVE} ORDER BY created_at, rowid"):
            if row[0] not in self._failed_in_memory:
                return self.batch(row[0])
        return None

    def set_status(self, batch_id: str, status: str) -> None:
        stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
                 "cancelling": "cancelling_at", "cancelled": "cancelled_at", "failed": "failed_at"}.get(status)
        sql = "UPDATE batches SET status = ?" + (f", {stamp} = coalesce({stamp}, ?)" if stamp else "") + " WHERE id = ?"
        self._write([(sql, (status, int(time.time()), batch_id) if stamp else (status, batch_id))],
                    "the batch's status")

    def fail(self, batch_id: str, message: str) -> None:
        """Mark a batch failed with `message` in its errors; in memory when the disk refuses even that."""
        try:
            self._write([("UPDATE batches SET errors = ? WHERE id = ?", (json.dumps(_errors(message)), batch_id))],
                        "the batch's error")
            self.set_status(batch_id, "failed")
        except StorageFull:
            self._failed_in_memory[batch_id] = message
        else:
            self._failed_in_memory.pop(batch_id, None)

    def pending(self, batch_id: str) -> list[PendingLine]:
        """The lines still to run, in order (parses every body: call it on a worker thread)."""
        rows = self._read("SELECT number, custom_id, url, body FROM lines WHERE batch_id = ? AND done = 0 "
                          "ORDER BY number", (batch_id,))
        return [PendingLine(row[0], row[1], row[2], json.loads(row[3])) for row in rows]

    def finish_line(self, batch_id: str, number: int, ok: bool, result: str) -> None:
        self._write([("UPDATE lines SET done = 1, ok = ?, result = ? WHERE batch_id = ? AND number = ? AND done = 0",
                      (int(ok), result, batch_id, number))], "a batch line's result")

    def finalize(self, batch_id: str, status: str) -> None:
        """Write the output file (lines that succeeded) and the error file (the rest), in line order
        (reads every result: call it on a worker thread)."""
        output, errors = [], []
        for ok, result in self._read("SELECT ok, result FROM lines WHERE batch_id = ? AND done = 1 ORDER BY number",
                                     (batch_id,)):
            (output if ok else errors).append(result)
        tenant = self.tenant(batch_id)
        statements: list[Write] = []
        for column, results in (("output_file_id", output), ("error_file_id", errors)):
            if results:
                file_id = f"file-{uuid.uuid4().hex}"
                statements += [("INSERT INTO files (id, purpose, filename, created_at, content, tenant) "
                                "VALUES (?, 'batch_output', ?, ?, ?, ?)",
                                (file_id, f"{batch_id}_{column.split('_')[0]}.jsonl", int(time.time()),
                                 "".join(results).encode("utf-8"), tenant)),
                               (f"UPDATE batches SET {column} = ? WHERE id = ?", (file_id, batch_id))]
        self._write(statements, "the batch's output")
        self.set_status(batch_id, status)

    @staticmethod
    def endpoints() -> tuple[str, ...]:
        return BATCH_URLS


def _file_object(row: sqlite3.Row) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed"}


def _errors(message: str) -> dict[str, Any]:
    """OpenAI's `errors` of a batch: a list object of {code, message, param, line}."""
    return {"object": "list", "data": [{"code": "batch_failed", "message": message, "param": None, "line": None}]}
