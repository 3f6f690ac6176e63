"""The batch store on a disk that refuses writes: an OSError (ENOSPC) or SQLite's own "full" is a
StorageFull (507), and a batch that cannot even be marked failed on disk reads as failed, with its
reason, and is never picked again."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from conveyor.errors import StorageFull
from conveyor.server.batch.store import BatchStore

LINE = b'{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}\n'


class FullDisk:
    """The store's connection, with every write refused as a full disk refuses it."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)

    def __enter__(self) -> Any:
        return self._db.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._db.__exit__(*exc)

    def _refuse(self, sql: str) -> None:
        if sql.split(None, 1)[0].upper() in ("INSERT", "UPDATE", "DELETE"):
            raise OSError(errno.ENOSPC, "No space left on device")

    def execute(self, sql: str, *args: Any) -> Any:
        self._refuse(sql)
        return self._db.execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> Any:
        self._refuse(sql)
        return self._db.executemany(sql, *args)


def test_writes_on_a_full_disk_are_storage_full_and_a_batch_fails_in_memory(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    file_id = store.add_file("in.jsonl", "batch", LINE)["id"]
    batch_id = store.add_batch(file_id, "/v1/completions", "24h", None)["id"]
    store.db = FullDisk(store.db)   # type: ignore[assignment]
    with pytest.raises(StorageFull) as refused:
        store.add_file("more.jsonl", "batch", LINE)
    assert refused.value.status == 507 and "No space left" in refused.value.message
    with pytest.raises(StorageFull):
        store.add_batch(file_id, "/v1/completions", "24h", None)
    with pytest.raises(StorageFull):
        store.finish_line(batch_id, 1, True, "{}\n")
    store.fail(batch_id, "the disk is full")
    batch = store.batch(batch_id)
    assert batch is not None and batch["status"] == "failed" and batch["failed_at"] is not None
    assert batch["errors"]["data"][0]["message"] == "the disk is full"
    assert store.next_active() is None and store.status(batch_id) == "failed"


def test_sqlite_full_is_storage_full(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    store.db.execute(f"PRAGMA max_page_count = {store.db.execute('PRAGMA page_count').fetchone()[0]}")
    with pytest.raises(StorageFull):
        store.add_file("big.jsonl", "batch", b"x" * 100_000)
    assert store.files() == []
