"""What a source checks of its system's schema at start-up: each a one-line ``ConfigError``.

A source's ``check_schema`` names its tables, columns and functions; these say what is
missing the same way for every source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.errors import ConfigError


def require_schema(conn: Connection, source: str, schema: str | None,
                   tables: Mapping[str, Sequence[str]], functions: Sequence[str] = (), *,
                   missing_schema: str = "") -> None:
    """A PostgreSQL system's schema (when named), each table with its columns and each
    SQL function, or one line naming the first thing missing (``missing_schema``: what
    the line adds when the schema itself is missing)."""
    require_postgresql(conn, source)
    if schema is not None and not sa.inspect(conn).has_schema(schema):
        raise ConfigError(f"source {source}: schema {schema!r} not found{missing_schema}")
    for table, columns in tables.items():
        require_columns(conn, source, table, schema, {c: c for c in columns})
    require_functions(conn, source, schema, functions)


def require_columns(conn: Connection, source: str, table: str, schema: str | None,
                    columns: Mapping[str, str]) -> dict[str, Any]:
    """Each named column of the table, or one ``ConfigError`` line naming what is missing.

    ``columns`` maps the config key (or the system's own name) to the column name.
    """
    inspector = sa.inspect(conn)
    where = f"schema {schema!r}" if schema else "the default schema"
    if not inspector.has_table(table, schema=schema):
        raise ConfigError(f"source {source}: table {table!r} not found in {where}")
    found = {c["name"]: c for c in inspector.get_columns(table, schema=schema)}
    for key, column in columns.items():
        if column not in found:
            label = f" ({key})" if key != column else ""
            raise ConfigError(f"source {source}: column {column!r}{label} not found in "
                              f"table {table!r}")
    return found


_FUNCTION_EXISTS = sa.text(
    "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
    "WHERE p.proname = :name AND (n.nspname = CAST(:schema AS text) OR "
    "(CAST(:schema AS text) IS NULL AND n.nspname = ANY (current_schemas(false))))")


def require_functions(conn: Connection, source: str, schema: str | None,
                      names: Sequence[str]) -> None:
    """Each named SQL function exists (PostgreSQL), or one line naming the first missing."""
    for name in names:
        if not conn.execute(_FUNCTION_EXISTS, {"name": name, "schema": schema}).scalar():
            where = f"schema {schema!r}" if schema else "the search path"
            raise ConfigError(f"source {source}: function {name}() not found in {where}")


def require_postgresql(conn: Connection, source: str) -> None:
    """Foreign job systems live in PostgreSQL; anything else is one line."""
    if conn.dialect.name != "postgresql":
        raise ConfigError(f"source {source} needs PostgreSQL (the database_url is "
                          f"{conn.dialect.name})")
