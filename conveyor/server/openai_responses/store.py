"""Stored responses of the Responses API (`store`, `previous_response_id`, GET and DELETE /v1/responses/{id}).

A response and the conversation that led to it are one row of an SQLite database: in memory by default,
or a file (`--responses-store PATH`, or `responses.sqlite3` under `--state-dir`) that every server of the
host can open, so a follow-up that lands on another replica or a restarted server finds its predecessor.
The store is bounded in count and in bytes (as JSON); the least recently used rows go first, whichever
server wrote them. Every call is short and takes the store's lock; the routes run them on a worker thread
(another process may hold the database's write lock for a moment).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from conveyor.errors import NotFound, StorageFull

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 * 2**20   # conversations can be long: the store is bounded in size as well as count
_BUSY_TIMEOUT_MS = 5000         # another server writing the same file holds its lock this long at most
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, response TEXT NOT NULL, conversation TEXT NOT NULL, bytes INTEGER NOT NULL,
    used_ns INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS responses_used ON responses (used_ns);
"""
# Rows past the count or the byte bound, most recently used kept first (the newest row always stays).
_EVICT = """
DELETE FROM responses WHERE id IN (
    SELECT id FROM (SELECT id, ROW_NUMBER() OVER recent AS n, SUM(bytes) OVER recent AS total
                    FROM responses WINDOW recent AS (ORDER BY used_ns DESC, id))
    WHERE n > 1 AND (n > ? OR total > ?))
"""


class ResponseStore:
    """The last `max_stored` responses and their conversations, at most `max_bytes` of them."""

    def __init__(self, path: Path | None = None, max_stored: int = MAX_STORED_RESPONSES,
                 max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_stored, self.max_bytes = max_stored, max_bytes
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(":memory:" if path is None else str(path), check_same_thread=False,
                                  isolation_level=None, timeout=_BUSY_TIMEOUT_MS / 1000)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def _run(self, sql: str, parameters: tuple[Any, ...]) -> sqlite3.Cursor:
        try:
            return self.db.execute(sql, parameters)
        except sqlite3.OperationalError as exc:   # full, read-only or locked past the busy timeout
            raise StorageFull(f"the responses store could not be written: {exc}") from None

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        response_text, conversation_text = json.dumps(response), json.dumps(conversation)
        size = len(response_text) + len(conversation_text)
        with self._lock:
            self._run("BEGIN IMMEDIATE", ())
            try:
                self._run("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                          (response["id"], response_text, conversation_text, size, time.time_ns()))
                self._run(_EVICT, (self.max_stored, self.max_bytes))
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self._run("COMMIT", ())

    def get(self, response_id: str, param: str = "response_id") -> tuple[dict[str, Any], list[dict[str, Any]]]:
        with self._lock:
            row = self._run("SELECT response, conversation FROM responses WHERE id = ?", (response_id,)).fetchone()
            if row is not None:
                self._run("UPDATE responses SET used_ns = ? WHERE id = ?", (time.time_ns(), response_id))
        if row is None:
            where = "in memory" if self.path is None else f"in {self.path}"
            raise NotFound(f"no stored response {response_id!r} (this server keeps the last {self.max_stored} "
                           f"{where})", param=param)
        return json.loads(row[0]), json.loads(row[1])

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._run("DELETE FROM responses WHERE id = ?", (response_id,))
