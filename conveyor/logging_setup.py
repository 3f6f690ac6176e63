"""The process's log handlers: one format on stderr. Entry points call it (the CLI, a spawned core
process, which starts with no logging set up); library modules only get loggers."""

from __future__ import annotations

import logging
import sys


class _UvicornNames(logging.Filter):
    """uvicorn logs its server's life (start-up, the address, shutdown) under `uvicorn.error` whatever
    the level; those lines are shown as `uvicorn`, and its access lines stay `uvicorn.access`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.error":
            record.name = "uvicorn"
        return True


def configure_logging(level: str | None, default: str) -> None:
    logging.basicConfig(level=(level or default).upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_UvicornNames())
