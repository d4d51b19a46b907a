"""Engines for both backends, with the transaction behaviour the lease contract needs.

SQLite: WAL so readers never block the writer, a busy timeout so writers queue instead of
failing, and ``BEGIN IMMEDIATE`` for every write transaction so the write lock is taken
before the first read (no read-then-upgrade deadlocks, no lost compare-and-swap).
PostgreSQL: READ COMMITTED with row locks and ``SKIP LOCKED`` in the store's queries.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.engine.url import make_url
from sqlalchemy.exc import ArgumentError

from reconciler.errors import ConfigError
from reconciler.storage.clock import sqlite_clock

SQLITE_BUSY_TIMEOUT_MS = 30_000
READ_ONLY = "reconciler_read_only"


def create_engine(database_url: str, **kwargs: Any) -> Engine:
    """Create an engine for a ``sqlite:///`` or ``postgresql+psycopg://`` URL."""
    try:
        url = make_url(database_url)
    except ArgumentError as exc:
        raise ConfigError(f"database_url is not a valid database URL: {database_url!r}") from exc
    backend = url.get_backend_name()
    if backend == "sqlite":
        return _sqlite_engine(url, **kwargs)
    if backend == "postgresql":
        if url.drivername == "postgresql":
            url = url.set(drivername="postgresql+psycopg")
        if url.get_driver_name() != "psycopg":
            raise ConfigError("database_url: PostgreSQL URLs must use the psycopg driver "
                              "(postgresql+psycopg://...)")
        kwargs.setdefault("pool_pre_ping", True)
        return sa.create_engine(url, **kwargs)
    raise ConfigError(f"database_url: unsupported database {backend!r}; "
                      "use sqlite:///PATH or postgresql+psycopg://...")


def _sqlite_engine(url: sa.URL, **kwargs: Any) -> Engine:
    if url.database in (None, "", ":memory:"):
        raise ConfigError("database_url: an in-memory SQLite database cannot be shared "
                          "between workers and the reconciler; use sqlite:///PATH")
    engine = sa.create_engine(url, **kwargs)

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from the driver so BEGIN IMMEDIATE is ours to emit.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()
        # Where the database clock starts: 'now', except in tests that freeze it.
        dbapi_connection.create_function("reconciler_clock", 0, sqlite_clock,
                                         deterministic=True)

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        read_only = conn.get_execution_options().get(READ_ONLY, False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def read_only(conn: Connection) -> Connection:
    """Mark a connection's transactions as read-only (a deferred BEGIN on SQLite)."""
    return conn.execution_options(**{READ_ONLY: True})


def is_postgresql(engine: Engine | Connection) -> bool:
    """True when the engine speaks PostgreSQL."""
    return engine.dialect.name == "postgresql"
