"""MySQL and MariaDB engines: what InnoDB needs set for the lease contract.

- READ COMMITTED, set on the engine: a claim's ``SELECT ... FOR UPDATE SKIP LOCKED`` and a
  pass's fenced ``UPDATE`` then lock the rows they read and no gap between them (InnoDB's
  default, REPEATABLE READ, takes gap locks that make concurrent claims deadlock).
- Every session in UTC (``time_zone = '+00:00'``): the database clock is
  ``UTC_TIMESTAMP(6)`` and ``DATETIME(6)`` columns hold UTC, as on the other engines.
- Lock waits bounded by ``innodb_lock_wait_timeout`` and ``lock_wait_timeout`` (row and
  metadata locks, whole seconds) and statements by
  ``max_statement_time`` (MariaDB, seconds) or ``max_execution_time`` (MySQL, ms, reads).
- A server older than MySQL 8.0 or MariaDB 10.6 (no ``SKIP LOCKED``) is one line.
"""

from __future__ import annotations

import math
import re
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from reconciler.errors import ConfigError

MINIMUM = {"MariaDB": (10, 6), "MySQL": (8, 0)}
"""The oldest server of each kind with ``SKIP LOCKED``."""


def mysql_engine(url: sa.URL, *, connect_seconds: int, statement_seconds: float | None,
                 lock_seconds: float | None, **kwargs: Any) -> Engine:
    """An engine for a ``mysql+pymysql://`` URL with the lease contract's settings and the
    given limits (seconds; None: none)."""
    if url.drivername not in ("mysql", "mariadb", "mysql+pymysql", "mariadb+pymysql"):
        raise ConfigError("database_url: MySQL and MariaDB URLs must use the PyMySQL driver "
                          "(mysql+pymysql://...)")
    # One dialect for both servers (the "mysql" dialect finds a MariaDB from its version):
    # the store's MySQL statements are compiled for that name.
    url = url.set(drivername="mysql+pymysql")
    try:
        import pymysql  # type: ignore[import-untyped]  # noqa: F401, PLC0415
    except ModuleNotFoundError:
        raise ConfigError("database_url: a MySQL or MariaDB database needs the package "
                          "'pymysql', which is not installed: pip install "
                          "'stale-claim-reconciler[mysql]'") from None
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("connect_timeout", connect_seconds)
    connect_args.setdefault("charset", "utf8mb4")
    kwargs.setdefault("pool_pre_ping", True)
    engine = sa.create_engine(url, connect_args=connect_args,
                              isolation_level="READ COMMITTED", **kwargs)

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("SELECT VERSION()")
        (version,) = cursor.fetchone()
        require_supported(str(version))
        limits = _limits(str(version), statement_seconds, lock_seconds)
        record.info[_ENGINE_LIMITS] = (str(version), limits)
        cursor.execute(f"{limits}, time_zone = '+00:00'")
        cursor.close()
        dbapi_connection.commit()

    @sa.event.listens_for(engine, "reset")
    def _on_reset(dbapi_connection: Any, record: Any, _state: Any) -> None:
        # A transaction's own limits (``limit_session``) end with its checkout.
        if record.info.pop(_LIMITED, False):
            cursor = dbapi_connection.cursor()
            cursor.execute(record.info[_ENGINE_LIMITS][1])
            cursor.close()

    return engine


_ENGINE_LIMITS = "reconciler_mysql_limits"
_LIMITED = "reconciler_mysql_limited"
NO_LOCK_LIMIT = 100_000_000
"""innodb_lock_wait_timeout's largest value on MariaDB (three years; MySQL's is ten times
that): no limit."""
METADATA_LOCK_LIMIT_MAX = 31_536_000
"""lock_wait_timeout's largest value (a year)."""


def _limits(version: str, statement_seconds: float | None, lock_seconds: float | None) -> str:
    """``SET SESSION`` of a lock wait and a statement limit (None: none)."""
    lock = _whole_seconds(lock_seconds) or NO_LOCK_LIMIT
    # innodb_lock_wait_timeout bounds row locks only; a table's metadata lock (held by a
    # migration's ALTER TABLE or a LOCK TABLES) is waited on for lock_wait_timeout, a day
    # by default: bounded by the same limit, so that such a wait ends as lock_timeout too.
    return (f"SET SESSION innodb_lock_wait_timeout = {lock}, "
            f"lock_wait_timeout = {min(lock, METADATA_LOCK_LIMIT_MAX)}, "
            f"{_statement_limit(version, statement_seconds or 0.0)}")


def limit_session(conn: Connection, *, statement_seconds: float | None,
                  lock_seconds: float | None) -> None:
    """Give ``conn``'s transaction its own lock wait and statement limits (None: none).

    MySQL has no ``SET LOCAL``: the session's limits change, and the engine's are set back
    when the connection returns to the pool.
    """
    info = conn.connection.info
    conn.exec_driver_sql(_limits(info[_ENGINE_LIMITS][0], statement_seconds, lock_seconds))
    info[_LIMITED] = True


def _whole_seconds(seconds: float | None) -> int | None:
    return None if seconds is None else max(1, math.ceil(seconds))


def server_kind(version: str) -> tuple[str, tuple[int, int]]:
    """``("MariaDB" | "MySQL", (major, minor))`` from ``SELECT VERSION()``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    numbers = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    return ("MariaDB" if "mariadb" in version.lower() else "MySQL"), numbers


def require_supported(version: str) -> None:
    """ConfigError, one line naming what is supported, for a server without SKIP LOCKED
    (``version``: its ``SELECT VERSION()``)."""
    kind, numbers = server_kind(version)
    oldest = MINIMUM[kind]
    if numbers < oldest:
        raise ConfigError(
            f"database_url: {kind} {numbers[0]}.{numbers[1]} is not supported (no SKIP "
            f"LOCKED); use MySQL 8.0+ or MariaDB 10.6+")


def _statement_limit(version: str, seconds: float) -> str:
    kind, _ = server_kind(version)
    if kind == "MariaDB":
        return f"max_statement_time = {seconds:.3f}"
    return f"max_execution_time = {math.ceil(seconds * 1000)}"
