"""What a mapped table must allow before the reconciler writes to it, and what it cannot read.

A status value the table refuses would fail every swap; one it accepts but nothing uses
strands the jobs written with it (``queued = "pendng"``: requeued, never claimed) or finds
none (``processing = "running"``: 0 candidates for ever). So the mapped values are checked
at ``db upgrade --config`` and at start: a value the column's enum or a CHECK constraint on
the column forbids is refused in one line (the optional ``cancelled`` too); one never seen
in the column is warned about in one line (not ``cancelled``: only an operator writes it).
The checks only read (a CHECK is evaluated over a one-row probe, never by writing to the
table).

SQLite keeps any value in any column, so a time column may hold what its engine cannot
read as a time (an epoch integer, ``'yesterday'``): such a job is a ``reconcile_error``
naming the column, never a live lease.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from reconciler.errors import ConfigError
from reconciler.sources.kit.shapes import constant
from reconciler.sources.table.config import TableConfig
from reconciler.storage.clock import seconds_since

log = logging.getLogger("reconciler.sources")

TIME_KEYS = ("lease_expires_column", "activity_column")
"""The mapped columns read as times."""

UNREADABLE_TIMESTAMP = "unreadable_timestamp"
"""The ``error_code`` of a job whose mapped time column holds what is not a time."""


def status_values(config: TableConfig) -> dict[str, str]:
    """The mapped status values by their config key (``cancelled`` where mapped)."""
    values = {"processing": config.processing, "queued": config.queued,
              "failed": config.failed}
    if config.cancelled is not None:
        values["cancelled"] = config.cancelled
    return values


def check_status_values(conn: Connection, source: str, config: TableConfig,
                        column: Mapping[str, Any]) -> None:
    """Refuse a mapped status value the status column's enum or CHECK forbids (one line);
    warn, one line each, about a value no row holds."""
    name = config.status_column
    allowed = getattr(column.get("type"), "enums", None)
    for key, value in status_values(config).items():
        if allowed and value not in allowed:
            raise ConfigError(f"source {source}: {key} = {value!r} is not a value of column "
                              f"{name!r} (its type allows {', '.join(map(repr, allowed))})")
    checks = _checks_on(conn, config)
    for key, value in status_values(config).items():
        for check in checks:
            if _refuses(conn, check, name, value):
                raise ConfigError(f"source {source}: {key} = {value!r} is refused by a CHECK "
                                  f"constraint on column {name!r} of table {config.table!r}")
    table = sa.table(config.table, sa.column(name), schema=config.schema)
    for key, value in status_values(config).items():
        if key == "cancelled":
            continue  # only an operator's cancel writes it: no row holds it until one does
        seen = conn.execute(sa.select(sa.literal(1)).select_from(table)
                            .where(table.c[name] == constant(value)).limit(1)).first()
        if seen is None:
            log.warning("event=status_value_unseen source=%s key=%s value=%r column=%s",
                        source, key, value, name)


def _checks_on(conn: Connection, config: TableConfig) -> list[str]:
    """The text of each CHECK constraint of the table that names the status column."""
    try:
        found = sa.inspect(conn).get_check_constraints(config.table, schema=config.schema)
    except NotImplementedError:  # pragma: no cover - both engines list their checks
        return []
    return [str(c["sqltext"]) for c in found if config.status_column in str(c["sqltext"])]


def _refuses(conn: Connection, check: str, column: str, value: str) -> bool:
    """Whether ``check`` is false for a row whose status column is ``value``: the check is
    evaluated over a one-row probe that has only that column. A check that reads other
    columns cannot be judged so and is not held against the value."""
    quoted = conn.dialect.identifier_preparer.quote(column)
    # MySQL 8 casts to CHAR(n) only (MariaDB takes either).
    text = "CHAR(4000)" if conn.dialect.name == "mysql" else "VARCHAR(4000)"
    # The check's text is the database's own catalog, not input; the value is bound.
    sql = (f"SELECT CASE WHEN ({check}) THEN 1 WHEN NOT ({check}) THEN 0 END "  # noqa: S608
           f"FROM (SELECT CAST(:probe_value AS {text}) AS {quoted}) AS probe")
    probe = sa.text(sql)
    nested = conn.begin_nested() if conn.dialect.name == "postgresql" else None
    try:
        verdict = conn.execute(probe, {"probe_value": value}).scalar()
    except DBAPIError:
        if nested is not None:
            nested.rollback()
        return False
    if nested is not None:
        nested.commit()
    return verdict == 0


def unreadable_time(column: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """True for a value the engine cannot read as a time (SQLite's ``julianday`` gives NULL
    for ``'yesterday'`` and for an epoch integer, beyond its day numbers)."""
    return sa.and_(column.is_not(None), seconds_since(column).is_(None))
