"""The rows a swap read, sent back to the database as one JSON parameter to join the swap
to (the pass's batch swap and the operator's chunk swap of a mapped table, pg-boss's chunk
swap), each value as its column's own type, so that a fence compares like with like."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Connection

from reconciler.storage.sql import POSTGRESQL, json_rows


def rows_as_read(conn: Connection, table: sa.TableClause, names: Sequence[str],
                 rows: Sequence[Mapping[str, Any]]) -> tuple[Any, dict[str, Any]]:
    """``rows`` of ``table``'s columns ``names``, each value as a read of the column gave
    it, as one JSON parameter read back as a table ``seen`` to join a swap to; with the
    parameter's value. A fence compares each with its column, so each must come back as
    the column's own type, whatever the user's: on PostgreSQL rows of the table's own
    type (``jsonb_populate_recordset``: an enum status, a timestamp with or without its
    zone); elsewhere ``json_rows``, which on SQLite gives each value as stored (the read
    gave it so) and on MySQL takes a type per column, here the type of the values read (a
    datetime compared as DATETIME, not as text)."""
    # Sent as text: datetimes (and decimals) by their text, parsed back by the type.
    params = {"seen_rows": json.dumps(rows, default=str)}
    dialect = conn.dialect.name
    if dialect == POSTGRESQL:
        row_type = conn.dialect.identifier_preparer.format_table(table)
        payload = sa.cast(sa.bindparam("seen_rows", type_=sa.Text()), JSONB)
        return (sa.func.jsonb_populate_recordset(sa.literal_column(f"NULL::{row_type}"),
                                                 payload)
                .table_valued(*names).alias("seen"), params)
    return json_rows(dialect, "seen", [(name, _read_type(row.get(name) for row in rows))
                                       for name in names]), params


def _read_type(values: Iterable[Any]) -> sa.types.TypeEngine[Any]:
    """The type a column's values read as (the first not NULL; none: any will do)."""
    value = next((v for v in values if v is not None), None)
    if isinstance(value, int):
        return sa.BigInteger()
    if isinstance(value, float):
        return sa.Float()
    if isinstance(value, datetime):
        return sa.DateTime()
    return sa.String()
