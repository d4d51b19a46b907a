"""Engines for both backends, with the transaction behaviour the lease contract needs.

SQLite: WAL so readers never block the writer (set once, when the reconciler creates the
file: its own embedded database; a file that was there before is somebody's, and its
journal mode, which persists in the file, is left as it is), a busy timeout so writers
queue instead of failing, and ``BEGIN IMMEDIATE`` for every write transaction so the write
lock is taken before the first read (no read-then-upgrade deadlocks, no lost compare-and-swap).
PostgreSQL: READ COMMITTED with row locks and ``SKIP LOCKED`` in the store's queries.

Nothing waits on the database forever. On PostgreSQL a connection gives up after
``connect_timeout``; the server cancels a statement after ``statement_timeout`` and a lock
wait after ``lock_timeout``; and since a server that is frozen (SIGSTOP, a VM paused, a
listener that never answers) enforces none of those, the client gives up on any reply
that has not come ``ANSWER_MARGIN_SECONDS`` after the statement timeout, breaking the
connection (the pool then replaces it). On SQLite the busy timeout bounds lock waits.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.engine.url import make_url
from sqlalchemy.exc import ArgumentError

from reconciler.config.settings import Settings
from reconciler.errors import ConfigError, DatabaseUnavailableError, SchemaOutOfDateError
from reconciler.redaction import redact
from reconciler.storage.clock import sqlite_clock

READ_ONLY = "reconciler_read_only"
LOCK_WAIT = "reconciler_lock_wait_seconds"
SUPPORTED_URLS = ("sqlite:///PATH, postgresql+psycopg://... (PostgreSQL 13+) or "
                  "mysql+pymysql://... (MySQL 8.0+, MariaDB 10.6+)")
ANSWER_MARGIN_SECONDS = 2.0
"""How much longer than its statement timeout the client waits for a reply."""

@dataclass(frozen=True, slots=True)
class DatabaseTimeouts:
    """How long each kind of database wait may last, in seconds (None: no limit)."""

    connect_seconds: int
    statement_seconds: float | None
    lock_seconds: float | None
    sqlite_busy_seconds: float
    pass_statement_seconds: float | None
    pass_lock_seconds: float | None

    @classmethod
    def from_settings(cls, settings: Settings) -> DatabaseTimeouts:
        """The timeouts the settings ask for (the pass's derived from the interval)."""
        pass_statement, pass_lock = settings.pass_timeouts
        return cls(
            connect_seconds=settings.connect_timeout_seconds,
            statement_seconds=settings.statement_timeout_seconds,
            lock_seconds=settings.lock_timeout_seconds,
            sqlite_busy_seconds=settings.sqlite_busy_timeout_seconds,
            pass_statement_seconds=pass_statement, pass_lock_seconds=pass_lock,
        )


    @classmethod
    def for_passes(cls, settings: Settings) -> DatabaseTimeouts:
        """The sidecar's: every session carries the pass timeouts, so a pass needs no
        ``SET LOCAL`` of its own (one round trip fewer on every pass, most of which find
        nothing to do); its chores run under the same interval-derived limits."""
        timeouts = cls.from_settings(settings)
        return replace(timeouts, statement_seconds=timeouts.pass_statement_seconds,
                       lock_seconds=timeouts.pass_lock_seconds)


# The defaults are the settings' defaults (declared once, on Settings).
DEFAULT_TIMEOUTS: Final = DatabaseTimeouts.from_settings(Settings.model_construct())
# For tools that legitimately run long statements (migrations by hand, benchmark datasets):
# only the connection attempt is bounded.
UNLIMITED_TIMEOUTS: Final = DatabaseTimeouts(
    connect_seconds=DEFAULT_TIMEOUTS.connect_seconds, statement_seconds=None,
    lock_seconds=None, sqlite_busy_seconds=DEFAULT_TIMEOUTS.sqlite_busy_seconds,
    pass_statement_seconds=None, pass_lock_seconds=None)


def create_engine(database_url: str, *, timeouts: DatabaseTimeouts | None = None,
                  must_exist: bool = False, **kwargs: Any) -> Engine:
    """Create an engine for a ``sqlite:///`` or ``postgresql+psycopg://`` URL.

    ``must_exist``: a SQLite file that is not there is an error naming it (commands other
    than ``db upgrade`` must not leave an empty database file behind).
    """
    timeouts = timeouts or DEFAULT_TIMEOUTS
    url = parse_database_url(database_url)
    backend = url.get_backend_name()
    if backend == "sqlite":
        engine = _sqlite_engine(url, timeouts, must_exist, **kwargs)
    elif backend == "postgresql":
        engine = _postgresql_engine(url, timeouts, **kwargs)
    elif backend in ("mysql", "mariadb"):
        from reconciler.storage.mysql import mysql_engine  # noqa: PLC0415

        engine = mysql_engine(url, connect_seconds=timeouts.connect_seconds,
                              statement_seconds=timeouts.statement_seconds,
                              lock_seconds=timeouts.lock_seconds, **kwargs)
    else:
        raise ConfigError(f"database_url: unsupported database {backend!r}; use "
                          f"{SUPPORTED_URLS}")
    return engine


def parse_database_url(database_url: str) -> sa.URL:
    """The URL, or a ConfigError that names the problem without echoing the URL."""
    try:
        url = make_url(database_url)
    except ArgumentError:
        raise ConfigError(
            f"database_url is not a valid database URL ({display_url(database_url)}); "
            "expected sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB") from None
    except ValueError:
        # make_url's int() of the port: the message would quote the URL's text.
        raise ConfigError("database_url: the port is not a number "
                          f"({display_url(database_url)})") from None
    if url.host is not None and "@" in url.host:
        raise ConfigError("database_url: the host part contains '@'; percent-encode an '@' "
                          "in the user name or password as %40")
    return url


def _postgresql_engine(url: sa.URL, timeouts: DatabaseTimeouts, **kwargs: Any) -> Engine:
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    if url.get_driver_name() != "psycopg":
        raise ConfigError("database_url: PostgreSQL URLs must use the psycopg driver "
                          "(postgresql+psycopg://...)")
    connect_args = dict(kwargs.pop("connect_args", {}))
    if "connect_timeout" not in url.query:
        connect_args.setdefault("connect_timeout", timeouts.connect_seconds)
    # Server-side limits for every session; a pass narrows them with SET LOCAL.
    options = [str(url.query.get("options", "")), str(connect_args.get("options", ""))]
    options += [f"-c statement_timeout={_ms(timeouts.statement_seconds)}",
                f"-c lock_timeout={_ms(timeouts.lock_seconds)}"]
    connect_args["options"] = " ".join(o for o in options if o)
    kwargs.setdefault("pool_pre_ping", True)
    # The driver is imported here, by a PostgreSQL engine only: a command on SQLite never
    # pays for psycopg (``tests/unit/test_startup.py``).
    from reconciler.storage.answering import AnsweringConnection  # noqa: PLC0415

    engine = sa.create_engine(url, connect_args=connect_args, **kwargs)
    answer = _answer_seconds(timeouts.statement_seconds)

    @sa.event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        connection = AnsweringConnection.connect(*cargs, **cparams)
        connection.answer_seconds = answer
        return connection

    return engine


def _sqlite_engine(url: sa.URL, timeouts: DatabaseTimeouts, must_exist: bool,
                   **kwargs: Any) -> Engine:
    if url.database in (None, "", ":memory:"):
        raise ConfigError("database_url: an in-memory SQLite database cannot be shared "
                          "between workers and the reconciler; use sqlite:///PATH")
    if must_exist and not url.query.get("uri"):
        _require_sqlite_file(url)
    engine = sa.create_engine(url, **kwargs)
    busy_ms = _ms(timeouts.sqlite_busy_seconds)
    # Only a file this engine creates is the reconciler's own (``db upgrade`` on a path
    # with nothing there); the other settings below last for the connection only.
    own_file = not url.query.get("uri") and not Path(str(url.database)).exists()

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from the driver so BEGIN IMMEDIATE is ours to emit.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
        if own_file:
            cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()
        # Where the database clock starts: 'now', except in tests that freeze it.
        dbapi_connection.create_function("reconciler_clock", 0, sqlite_clock,
                                         deterministic=True)

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        options = conn.get_execution_options()
        # A transaction that asked for a shorter wait on the write lock gets it, and the
        # next one on this connection the engine's again (set only when it changes).
        wanted = _ms(options[LOCK_WAIT]) if LOCK_WAIT in options else busy_ms
        held = conn.connection.info
        if held.get("busy_ms", busy_ms) != wanted:
            conn.exec_driver_sql(f"PRAGMA busy_timeout = {wanted}")
            held["busy_ms"] = wanted
        conn.exec_driver_sql("BEGIN" if options.get(READ_ONLY, False) else "BEGIN IMMEDIATE")

    return engine


def _require_sqlite_file(url: sa.URL) -> None:
    path = Path(str(url.database))
    if path.exists():
        return
    shown = display_url(url.render_as_string(hide_password=True))
    if not path.parent.is_dir():
        raise DatabaseUnavailableError(
            f"cannot reach the database at {shown}: the folder {str(path.parent)!r} "
            "does not exist")
    raise SchemaOutOfDateError(
        f"no database at {str(path)!r}; run `reconciler db upgrade` to create it")


def limit_transaction(conn: Connection, *, statement_seconds: float | None,
                      lock_seconds: float | None) -> None:
    """Give the open transaction its own statement and lock timeouts (None: no limit).

    PostgreSQL: ``SET LOCAL`` (gone at commit or rollback), and the client's answer limit
    to match. MySQL: the session's, until the connection returns to the pool
    (``mysql.limit_session``). SQLite has neither; its busy timeout bounds lock waits.
    """
    if conn.dialect.name == "mysql":
        from reconciler.storage.mysql import limit_session  # noqa: PLC0415

        limit_session(conn, statement_seconds=statement_seconds, lock_seconds=lock_seconds)
        return
    if not is_postgresql(conn):
        return
    # SET LOCAL, in one round trip (set_config(..., true) is its function form).
    conn.exec_driver_sql(
        f"SELECT set_config('statement_timeout', '{_ms(statement_seconds)}', true), "
        f"set_config('lock_timeout', '{_ms(lock_seconds)}', true)")
    from reconciler.storage.answering import AnsweringConnection  # noqa: PLC0415

    dbapi = conn.connection.dbapi_connection
    if isinstance(dbapi, AnsweringConnection):
        dbapi.transaction_answer_seconds = _answer_seconds(statement_seconds)


def limit_pass_transaction(conn: Connection, timeouts: DatabaseTimeouts) -> None:
    """Give a pass's transaction the pass timeouts (derived from the interval); ``timeouts``
    are those the connection's engine was created with.

    A pass stuck behind a lock or a slow statement then fails, is recorded as an error pass
    (``lock_timeout``, ``timeout``) and the next tick goes on, instead of holding its row
    locks and the schedule.
    """
    if (timeouts.pass_statement_seconds, timeouts.pass_lock_seconds) == (
            timeouts.statement_seconds, timeouts.lock_seconds):
        return  # the sessions already carry them (DatabaseTimeouts.for_passes)
    limit_transaction(conn, statement_seconds=timeouts.pass_statement_seconds,
                      lock_seconds=timeouts.pass_lock_seconds)


def _ms(seconds: float | None) -> int:
    """A timeout in whole milliseconds for PostgreSQL or SQLite; 0 means none."""
    return 0 if seconds is None else max(1, math.ceil(seconds * 1000))


def _answer_seconds(statement_seconds: float | None) -> float | None:
    return None if statement_seconds is None else statement_seconds + ANSWER_MARGIN_SECONDS


def lock_wait(conn: Connection, seconds: float) -> Connection:
    """Bound how long a connection's transactions wait for SQLite's write lock (its busy
    timeout) to ``seconds``; PostgreSQL's lock waits are bounded by its lock timeout."""
    return conn.execution_options(**{LOCK_WAIT: seconds})


def read_only(conn: Connection) -> Connection:
    """Mark a connection's transactions as read-only (a deferred BEGIN on SQLite)."""
    return conn.execution_options(**{READ_ONLY: True})


def is_postgresql(engine: Engine | Connection) -> bool:
    """True when the engine speaks PostgreSQL."""
    return engine.dialect.name == "postgresql"


def display_url(database_url: str) -> str:
    """A database URL fit to print: the password hidden in every form it can take.

    A URL no parser accepts is not echoed beyond its scheme, since where its secret sits
    cannot be known.
    """
    try:
        shown = make_url(database_url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        scheme = database_url.split(":", 1)[0] if ":" in database_url else ""
        safe = re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.\-]{0,30}", scheme)
        return f"{scheme}:<unparseable URL>" if safe else "<unparseable URL>"
    return redact(shown)


def database_host(engine: Engine) -> str:
    """Where ``engine`` connects, for a log line: ``host:port`` (a socket's folder for a
    unix socket, the file for SQLite), never a user or a password."""
    url = engine.url
    if url.get_backend_name() == "sqlite":
        return str(url.database)
    host = url.host or str(url.query.get("host", "")) or "localhost"
    return f"{host}:{url.port}" if url.port else host
