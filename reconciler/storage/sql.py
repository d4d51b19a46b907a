"""SQL building blocks every store module shares: table handles and the few constructs
where PostgreSQL, SQLite and MySQL differ, each with a comment saying why. A construct that
differs takes the engine's dialect name (``conn.dialect.name``: ``POSTGRESQL``, ``SQLITE``,
``MYSQL``, which MariaDB is too).

PostgreSQL and MySQL take row locks with ``FOR UPDATE SKIP LOCKED``; SQLite serialises
writers with ``BEGIN IMMEDIATE`` (see reconciler.storage.engines), so the same statement
without the locking clause is equally atomic there. MySQL has no ``UPDATE ... RETURNING``
and no ``ON CONFLICT``: ``update_returning`` and ``upsert`` give their meaning there.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.visitors import InternalTraversal

from models import (
    JobArtifact,
    JobAttempt,
    JobRun,
    OperatorAction,
    OperatorHold,
    ReconcilerLease,
    ReconciliationDecision,
    ReconciliationPass,
    StepRun,
    WorkerSession,
)
from reconciler.core.evidence import PlanStep, parse_plan
from reconciler.core.vocabulary import JobStatus
from reconciler.storage.engines import is_postgresql

POSTGRESQL, SQLITE, MYSQL = "postgresql", "sqlite", "mysql"
PRIMARY_KEY = "FORCE INDEX (PRIMARY)"
"""MySQL's hint to read a table by its primary key (see ``update_returning``)."""

jobs: sa.Table = cast(sa.Table, JobRun.__table__)
steps: sa.Table = cast(sa.Table, StepRun.__table__)
attempts: sa.Table = cast(sa.Table, JobAttempt.__table__)
passes: sa.Table = cast(sa.Table, ReconciliationPass.__table__)
decisions: sa.Table = cast(sa.Table, ReconciliationDecision.__table__)
leases: sa.Table = cast(sa.Table, ReconcilerLease.__table__)
sessions: sa.Table = cast(sa.Table, WorkerSession.__table__)
artifacts: sa.Table = cast(sa.Table, JobArtifact.__table__)
actions: sa.Table = cast(sa.Table, OperatorAction.__table__)
holds: sa.Table = cast(sa.Table, OperatorHold.__table__)

WAKE_CHANNEL = "reconciler_jobs"

PROCESSING = JobStatus.PROCESSING.value
QUEUED = JobStatus.QUEUED.value
# Partial indexes are declared WHERE job_status = 'processing' (or 'queued'). A bound
# parameter in its place can keep a generic (prepared) plan from proving the index
# applies, so the scans that rely on those indexes spell the status out as a literal.
IN_PROCESSING = jobs.c.job_status == sa.literal_column(f"'{PROCESSING}'")
IN_QUEUE = jobs.c.job_status == sa.literal_column(f"'{QUEUED}'")
# The candidate scans' rows: written as the scan indexes' predicate (models.tables.SCANNED),
# which SQLite uses only when the query repeats it term for term.
SCANNED = sa.and_(IN_PROCESSING, sa.text("NOT job_runs.reconcile_parked"))

def session_gone() -> sa.ColumnElement[bool]:
    """True when the job's claim belongs to a worker session known to be gone."""
    return sa.exists().where(
        sessions.c.session_id == jobs.c.worker_session_id,
        sessions.c.stopped_at.is_not(None),
    )


def wake_workers(conn: Connection) -> None:
    """Tell idle workers that runnable jobs exist, once this transaction commits."""
    # PostgreSQL delivers NOTIFY at commit, so idle workers wake only for committed jobs.
    # SQLite has no such channel; its workers poll.
    if is_postgresql(conn):
        conn.execute(sa.select(sa.func.pg_notify(WAKE_CHANNEL, "")))


def insert_into(dialect: str, table: sa.Table) -> Any:
    """The dialect's INSERT: ON CONFLICT on PostgreSQL and SQLite, ON DUPLICATE KEY UPDATE
    on MySQL (``upsert`` writes either from one description)."""
    return {POSTGRESQL: postgresql.insert, MYSQL: mysql.insert}.get(dialect, sqlite.insert)(
        table)


def for_update(dialect: str, query: sa.Select[Any], *, lock: bool,
               skip_locked: bool = True) -> sa.Select[Any]:
    """Lock the selected rows where the engine has row locks."""
    # Row locks exist on PostgreSQL and InnoDB; SQLite's BEGIN IMMEDIATE already excludes
    # writers. Scans (claim, pass) skip rows others hold; a single named row waits for it.
    if lock and dialect != SQLITE:
        return query.with_for_update(skip_locked=skip_locked)
    return query


def upsert(dialect: str, table: sa.Table, values: dict[str, Any], *,
           keys: Sequence[sa.Column[Any]] = (),
           changes: Callable[[Any], dict[str, Any]] | None = None) -> Any:
    """INSERT ``values``, or where a row with the same ``keys`` exists (no keys: any
    conflict), set ``changes(new)`` (``new``: the refused row's columns; None: change
    nothing).

    MySQL's ON DUPLICATE KEY UPDATE fires on any unique key and assigns left to right, each
    assignment seeing those before it: ``changes`` lists a column before any column whose
    expression reads it.
    """
    stmt = insert_into(dialect, table).values(values)
    if dialect == MYSQL:
        # "Do nothing" is a key set to itself: INSERT IGNORE would also hide other errors.
        first = next(iter(table.primary_key.columns))
        assigned = (changes(stmt.inserted) if changes is not None
                    else {first.name: table.c[first.name]})
        return stmt.on_duplicate_key_update(list(assigned.items()))
    index = list(keys) or None
    if changes is None:
        return stmt.on_conflict_do_nothing(index_elements=index)
    return stmt.on_conflict_do_update(index_elements=index, set_=changes(stmt.excluded))


def update_returning(conn: Connection, update: sa.Update, *columns: Any,
                     params: dict[str, Any] | None = None) -> Sequence[sa.Row[Any]]:
    """``UPDATE ... RETURNING columns``: the rows the update changed, as they are after it.

    MySQL has no ``UPDATE ... RETURNING``: there the rows the update's predicate matches are
    locked first (``SELECT ... FOR UPDATE``, which reads their latest version), exactly
    those updated, and read back; their locks hold until the transaction ends, so nothing
    changes them in between and the predicate that held when they were locked still does.
    The predicate names its rows by primary key, which the lock reads them by: InnoDB locks
    every row a locking read reads, and through another index that may be every processing
    job, other transactions' among them (a deadlock).
    """
    params = params or {}
    if conn.dialect.name != MYSQL:
        return conn.execute(update.returning(*columns), params).all()
    table = cast(sa.Table, update.table)
    (key,) = table.primary_key.columns
    matched = update.whereclause if update.whereclause is not None else sa.true()
    locked = list(conn.execute(
        sa.select(key).where(matched).with_hint(table, PRIMARY_KEY, MYSQL).with_for_update(),
        params).scalars())
    if not locked:
        return []
    conn.execute(update.where(key.in_(locked)), params)
    return conn.execute(sa.select(*columns).where(key.in_(locked))).all()


class JsonTable(sa.sql.expression.TableClause):
    """A batch's JSON rows as a table on MySQL (``json_rows``): ``JSON_TABLE(:<name>_rows,
    '$[*]' COLUMNS (<column> <type> PATH '$.<column>', ...)) AS <name>``, MariaDB 10.6+ and
    MySQL 8.0.4+."""

    # Its cache key is its name and columns: the payload's name follows from the name.
    inherit_cache = True

    def __init__(self, name: str, columns: Sequence[tuple[str, Any]]) -> None:
        super().__init__(name, *(sa.column(column, kind) for column, kind in columns))
        self.payload = sa.bindparam(f"{name}_rows", type_=sa.Text())


# A JSON_TABLE column's SQL type by the column's type (most specific first).
_JSON_TABLE_TYPES: tuple[tuple[type[Any], str], ...] = (
    (sa.BigInteger, "BIGINT"), (sa.Integer, "INT"), (sa.Float, "DOUBLE"),
    (sa.Boolean, "BOOLEAN"), (sa.JSON, "JSON"), (sa.String, "VARCHAR(4000)"),
    (sa.DateTime, "DATETIME(6)"),
)


@compiles(JsonTable, "mysql")
def _mysql_json_table(element: JsonTable, compiler: Any, **kw: Any) -> str:
    name = compiler.preparer.quote(element.name)
    if not kw.get("asfrom"):
        return str(name)
    columns = ", ".join(
        f"{compiler.preparer.quote(c.name)} "
        f"{next(sql for kind, sql in _JSON_TABLE_TYPES if isinstance(c.type, kind))} "
        f"PATH '$.{c.name}'" for c in element.columns)
    payload = compiler.process(element.payload, **kw)
    return f"JSON_TABLE({payload}, '$[*]' COLUMNS ({columns})) AS {name}"


# MySQL's indexes of the claim and the scans (models.tables: no partial index there).
CLAIM_INDEX, EXPIRY_INDEX, ACTIVITY_INDEX = (
    "ix_job_runs_status_available", "ix_job_runs_status_lease_expiry",
    "ix_job_runs_status_last_activity")


def along(query: sa.Select[Any], index: str) -> sa.Select[Any]:
    """On MySQL, ``query`` reads ``jobs`` through ``index`` (``FORCE INDEX``). A locking
    scan locks every row it reads: on a small table the optimiser would read all and sort,
    locking every queued or stale job for one claim or batch; through the index it reads
    (and locks) the batch's rows only, in order. Other engines choose their own plan."""
    return query.with_hint(jobs, f"FORCE INDEX ({index})", "mysql")


def place_type(dialect: str) -> Any:
    """The type a scan's place (a lease expiry, a last activity) is read as and bound back
    as: the database's own value, never converted. SQLite stores timestamps as fixed-width
    text that sorts as it compares, so the text is the place (parsing two a row into aware
    datetimes cost about 1.5 us a job, for a cursor the pass reads once a batch);
    PostgreSQL's and MySQL's drivers give a timestamp as a datetime already."""
    return sa.String() if dialect == SQLITE else sa.DateTime(timezone=True)


def seconds_param(name: str) -> sa.BindParameter[float]:
    """A bound number of seconds."""
    return sa.bindparam(name, type_=sa.Float())


class unindexed(sa.sql.expression.ColumnElement[Any]):  # noqa: N801 - reads as SQL
    """A column SQLite and MySQL must not use an index for: ``+column`` on SQLite,
    ``COALESCE(column, column)`` on MySQL (PostgreSQL: the column).

    In ``UPDATE job_runs ... FROM <json rows>``, an index on ``job_status`` tempts SQLite
    to scan every processing job and probe the JSON rows for each; with the index ruled
    out it loops over the batch and finds each job by primary key. MySQL's InnoDB would
    also lock every row that scan reads, other replicas' batches among them.
    """

    inherit_cache = True
    # Without its traversal the element has no cache key, and neither has any statement
    # holding it: SQLAlchemy then compiles that statement anew on every execution.
    _traverse_internals = [  # noqa: RUF012 - SQLAlchemy declares it as a list
        ("column", InternalTraversal.dp_clauseelement)]

    def __init__(self, column: sa.ColumnElement[Any]) -> None:
        self.column = column
        self.type = column.type


@compiles(unindexed, "sqlite")
def _sqlite_unindexed(element: unindexed, compiler: Any, **kw: Any) -> str:
    return f"+{compiler.process(element.column, **kw)}"


@compiles(unindexed, "mysql")
def _mysql_unindexed(element: unindexed, compiler: Any, **kw: Any) -> str:
    column = compiler.process(element.column, **kw)
    return f"COALESCE({column}, {column})"


@compiles(unindexed)
def _plain_unindexed(element: unindexed, compiler: Any, **kw: Any) -> str:
    return str(compiler.process(element.column, **kw))


# No cycle check: the rows are built here, flat lists and dicts, never self-referencing.
_encoder = json.JSONEncoder(separators=(",", ":"), check_circular=False)


def encode_rows(rows: list[dict[str, Any]]) -> str:
    """A batch's rows as the JSON text of one parameter (StrEnum members encode as text)."""
    return _encoder.encode(rows)


def json_rows(dialect: str, name: str, columns: Sequence[tuple[str, Any]]) -> Any:
    """A whole batch as one JSON parameter ``<name>_rows``, read back as a table.

    One bind parameter instead of one per value: the statement text stays the same for
    every batch size, so it is compiled once and cached, and a batch of thousands costs
    one round trip. PostgreSQL reads it with ``json_to_recordset`` (``json``, not
    ``jsonb``: nested evidence passes through as text, never converted to binary); SQLite
    with ``json_each`` and ``json_extract`` (which returns nested objects as JSON text);
    MySQL with ``JSON_TABLE`` (``JsonTable``).
    """
    if dialect == MYSQL:
        return JsonTable(name, columns)
    payload = sa.bindparam(f"{name}_rows", type_=sa.Text())
    if dialect == POSTGRESQL:
        return (
            sa.func.json_to_recordset(sa.cast(payload, postgresql.JSON))
            .table_valued(*(sa.column(column, kind) for column, kind in columns))
            .render_derived(name=name, with_types=True)
        )
    each = sa.func.json_each(payload).table_valued("value").alias(f"{name}_each")
    return sa.select(*(
        sa.func.json_extract(each.c.value, f"$.{column}").label(column)
        for column, _ in columns
    )).subquery(name)


def in_batch(dialect: str, column: Any) -> Any:
    """``column`` in the batch of ids bound as ``batch_ids`` (see ``batch_ids``).

    PostgreSQL: ``= ANY(array)``, which an index scan takes directly. SQLite: ``IN`` over
    ``json_each``, which it probes the index with. MySQL: ``IN`` a list expanded at
    execution (the statement stays cached).
    """
    if dialect == MYSQL:
        return column.in_(sa.bindparam("batch_ids", expanding=True))
    if dialect == POSTGRESQL:
        return column == sa.any_(
            sa.bindparam("batch_ids", type_=postgresql.ARRAY(sa.BigInteger())))
    each = sa.func.json_each(sa.bindparam("batch_ids", type_=sa.Text()))
    return column.in_(sa.select(each.table_valued("value").c.value))


def key_in(conn: Connection, column: sa.ColumnElement[Any], texts: Sequence[str]
           ) -> sa.ColumnElement[bool]:
    """``column`` is one of ``texts``: ``= ANY`` of one bound array on PostgreSQL (a
    batch's keys as one parameter, not one each), ``IN`` elsewhere."""
    if conn.dialect.name != "postgresql":
        return column.in_(texts)
    return column == sa.any_(sa.cast(sa.literal(list(texts), postgresql.ARRAY(sa.String())),
                                     postgresql.ARRAY(sa.String())))


def unnest(name: str, columns: Sequence[tuple[str, sa.types.TypeEngine[Any], Sequence[Any]]]
           ) -> Any:
    """Rows given column by column as one FROM item (PostgreSQL):
    ``unnest(CAST(:a AS type[]), ...) AS name(a, ...)``; one bound array per column, so the
    statement is the same text (and cached) whatever the batch's size."""
    arrays = [sa.cast(sa.literal(list(values), postgresql.ARRAY(type_)),
                      postgresql.ARRAY(type_))
              for _, type_, values in columns]
    return (sa.func.unnest(*arrays)
            .table_valued(*(sa.column(column, type_) for column, type_, _ in columns))
            .render_derived(name=name))


def batch_ids(dialect: str, ids: list[int]) -> list[int] | str:
    """The value of ``batch_ids``: a list on PostgreSQL (an array) and MySQL (expanded),
    JSON text on SQLite."""
    return json.dumps(ids) if dialect == SQLITE else ids


def keyed(dialect: str, params: dict[str, Any], keys: Sequence[Any]) -> dict[str, Any]:
    """A batch statement's parameters, with the batch's job ids as ``batch_ids`` on MySQL
    (``transitions.by_key``)."""
    if dialect == MYSQL:
        params["batch_ids"] = batch_ids(MYSQL, [int(key) for key in keys])
    return params


def batch_params(dialect: str, name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch statement's parameters: its rows as JSON (``<name>``), keyed on MySQL."""
    return keyed(dialect, {name: encode_rows(rows)}, [row["job_id"] for row in rows])


def insert_id(conn: Connection, insert: sa.Insert, params: dict[str, Any] | None = None
              ) -> int:
    """The primary key of the one row ``insert`` adds: by RETURNING on PostgreSQL, the
    insert id on SQLite and MySQL (MySQL 8 has no RETURNING)."""
    key = conn.execute(insert, params or {}).inserted_primary_key
    if key is None:
        raise ValueError("the insert added no row")
    return int(key[0])


def as_float(value: Any) -> float | None:
    """A database number as a float, None kept."""
    return None if value is None else float(value)


def plan_steps(plan_text: str | None) -> tuple[PlanStep, ...]:
    """The plan as the client sees it; an unreadable plan gives no steps."""
    return parse_plan(plan_text) or ()


PLAN_TEXT = sa.cast(jobs.c.step_plan, sa.Text).label("plan_text")
"""The stored plan as raw text, so a malformed plan is evidence, not a failed read."""
