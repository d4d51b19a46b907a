"""The database's clock as SQL expressions: every lease comparison is made by the database.

Each construct compiles per engine. PostgreSQL uses ``statement_timestamp()`` so one
statement sees one instant. SQLite's ``'now'`` is fixed for one statement step too; it is
rendered as the same fixed-width UTC text that ``UtcDateTime`` stores, so comparisons are
exact string comparisons with microsecond width.

On SQLite, every clock expression starts from ``reconciler_clock()``, a function every
connection registers (reconciler.storage.engines). It returns ``'now'``, SQLite's own
reading, unless a test froze the clock with ``freeze_sqlite_clock``: the state-machine tests
use that to let virtual time pass. On MySQL the clock expressions read the session's clock
(``UTC_TIMESTAMP(6)``), which a test freezes with ``SET timestamp`` at the instant
``frozen_clock`` gives (tests/statemachine/harness.py).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Float, literal
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql import ColumnElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from models.base import UtcDateTime

SQLITE_FORMAT = "'%Y-%m-%d %H:%M:%f'"
SQLITE_NOW = "reconciler_clock()"

_sqlite_frozen_at: str | None = None
_frozen_posix: float | None = None


def freeze_sqlite_clock(posix_seconds: float | None) -> None:
    """Make every SQLite statement's 'now' (in this process) this instant. Tests only.

    ``None`` gives the real clock back. Frozen, the database's time neither runs while a
    call waits for the CPU nor differs between statements, so a test's model of time is
    exact to the millisecond.
    """
    global _sqlite_frozen_at, _frozen_posix  # noqa: PLW0603 - one process-wide test clock
    _frozen_posix = None if posix_seconds is None else round(posix_seconds, 3)
    _sqlite_frozen_at = None if _frozen_posix is None else (
        datetime.fromtimestamp(_frozen_posix, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3])


def frozen_clock() -> float | None:
    """The instant ``freeze_sqlite_clock`` froze (POSIX seconds, to the millisecond), or
    None for the real clock. Tests only: their MySQL sessions follow it."""
    return _frozen_posix


def sqlite_clock() -> str:
    """The time value SQLite's clock expressions start from (registered as ``reconciler_clock``).

    ``'now'``: SQLite's own clock. Registered deterministic, so SQLite computes each clock
    expression once per statement rather than once per row, and one statement sees one
    instant, as with ``statement_timestamp()`` on PostgreSQL.
    """
    return "now" if _sqlite_frozen_at is None else _sqlite_frozen_at


class db_now(FunctionElement[Any]):  # noqa: N801 - reads as a SQL function at call sites
    """The database's current time."""

    type = UtcDateTime()
    inherit_cache = True
    name = "db_now"


class db_now_plus(FunctionElement[Any]):  # noqa: N801
    """The database's current time plus a number of seconds (may be negative)."""

    type = UtcDateTime()
    inherit_cache = True
    name = "db_now_plus"


class seconds_since(FunctionElement[Any]):  # noqa: N801
    """Seconds from a timestamp column to the database's now (NULL stays NULL)."""

    type = Float()
    inherit_cache = True
    name = "seconds_since"


@compiles(db_now, "postgresql")
def _pg_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "statement_timestamp()"


@compiles(db_now, "sqlite")
def _sqlite_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    # strftime's %f gives milliseconds; pad to the six digits UtcDateTime stores.
    return f"(strftime({SQLITE_FORMAT}, {SQLITE_NOW}) || '000')"


@compiles(db_now_plus, "postgresql")
def _pg_now_plus(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    (seconds,) = element.clauses
    return f"(statement_timestamp() + make_interval(secs => {compiler.process(seconds, **kw)}))"


@compiles(db_now_plus, "sqlite")
def _sqlite_now_plus(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    (seconds,) = element.clauses
    modifier = f"printf('%+.3f seconds', {compiler.process(seconds, **kw)})"
    return f"(strftime({SQLITE_FORMAT}, {SQLITE_NOW}, {modifier}) || '000')"


@compiles(seconds_since, "postgresql")
def _pg_seconds_since(element: seconds_since, compiler: SQLCompiler, **kw: Any) -> str:
    (column,) = element.clauses
    # EXTRACT yields numeric; float8 reaches Python as a float, not a Decimal.
    return (f"EXTRACT(EPOCH FROM (statement_timestamp() - {compiler.process(column, **kw)}))"
            "::float8")


@compiles(seconds_since, "sqlite")
def _sqlite_seconds_since(element: seconds_since, compiler: SQLCompiler, **kw: Any) -> str:
    (column,) = element.clauses
    return (f"((julianday({SQLITE_NOW}) - julianday({compiler.process(column, **kw)}))"
            " * 86400.0)")


def now_plus(seconds: float | ColumnElement[Any]) -> db_now_plus:
    """``db_now_plus`` with a plain number bound as a float parameter."""
    value = seconds if isinstance(seconds, ColumnElement) else literal(float(seconds), Float())
    return db_now_plus(value)


@compiles(db_now, "mysql")
def _mysql_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "UTC_TIMESTAMP(6)"


@compiles(db_now_plus, "mysql")
def _mysql_now_plus(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    (seconds,) = element.clauses
    # Whole microseconds: TIMESTAMPADD takes an integer count of its unit.
    return (f"TIMESTAMPADD(MICROSECOND, CAST(ROUND({compiler.process(seconds, **kw)} "
            "* 1000000) AS SIGNED), UTC_TIMESTAMP(6))")


@compiles(seconds_since, "mysql")
def _mysql_seconds_since(element: seconds_since, compiler: SQLCompiler, **kw: Any) -> str:
    (column,) = element.clauses
    return (f"(TIMESTAMPDIFF(MICROSECOND, {compiler.process(column, **kw)}, "
            "UTC_TIMESTAMP(6)) / 1000000.0)")
