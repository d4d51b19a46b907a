"""The run's database, read by the harness with a connection per query (it survives the
PostgreSQL restart the run causes)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import psycopg

RETRY_SECONDS = 30.0


@dataclass(frozen=True)
class Database:
    """One database of the run's throwaway PostgreSQL: SQLAlchemy and libpq URLs."""

    url: str
    libpq: str

    def conninfo(self, search_path: str) -> str:
        """A libpq URL with a search path (as Procrastinate's workers connect)."""
        return f"{self.libpq}?options=-csearch_path%3D{search_path}"

    def query(self, sql: str, params: dict[str, Any] | None = None, *,
              search_path: str | None = None) -> list[tuple[Any, ...]]:
        """Run one statement in its own transaction, retrying while the server restarts;
        its rows (none for a statement that returns none)."""
        deadline = time.monotonic() + RETRY_SECONDS
        while True:
            try:
                with psycopg.connect(self.libpq, connect_timeout=5) as conn:
                    if search_path is not None:
                        conn.execute(f"SET search_path TO {search_path}")
                    cursor = conn.execute(sql, params)
                    return cursor.fetchall() if cursor.description else []
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
