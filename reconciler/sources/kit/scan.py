"""The statement that finds a pass's expired candidates and the brake's counts at once.

A recovering pass used to read the running jobs twice, once to find candidates and once
for the brake's counts: a sequential read of the whole job table each time where the
system keeps no index on its claimed jobs. Here one read of the running jobs is kept
(``MATERIALIZED``) and both are taken from it; the candidates' rows are then found again
and locked by their physical address (``tableoid``, ``ctid``: a lookup each, not a
second read), skipping those another replica holds, until the batch is full. A row
changed since the read has another address and is left out, as a row whose fence no
longer holds would be. The counts are subqueries over the kept read, computed once a
row is returned: a quiet pass never pays for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.sources.kit.shapes import Shape
from reconciler.storage.sql import MYSQL

Unheld = Callable[[sa.ColumnElement[Any]], sa.ColumnElement[bool]]
"""Given a job's key column, true where no operator holds the job."""


def expired_scan(running: sa.Select[Any], expired: sa.ColumnElement[bool],
                 order: sa.ColumnElement[Any], target: Any, *, limit: int,
                 after: Any | None, locking: bool, unheld: Unheld) -> sa.Select[Any]:
    """The expired rows of ``running`` (every running job of a reconciled kind, with
    ``job_id`` labelled) after the key ``after``, in ``order``, at most ``limit``, locked
    in ``target`` when ``locking``; each row with ``running_total`` and
    ``expired_total``, the brake's counts (a held job is not counted stale: it is stale
    on purpose, as a native held job is)."""
    if not locking:
        # Nothing to lock here (SQLite; a dry run; MySQL, whose kit locks the rows found
        # by key afterwards): the candidates' columns are kept with the read and taken
        # from it.
        kept = running.add_columns(expired.label("expired"), order.label("scan_key"))
        read = _kept(kept.cte("running"))
        scan = sa.select(*(read.c[c.name] for c in running.selected_columns),
                         *_totals(read, unheld)).select_from(read)
    else:
        # Only what counting, ordering and finding each row again need is kept (a quiet
        # pass stores a few narrow columns of each running job, not its candidate's); the
        # candidates' columns are read from the locked rows themselves, found by address:
        # a TID lookup for each chosen row (the plan while they are few against the
        # table), and the table's oid tells apart the rows of a partitioned table's
        # partitions. No ``ctid = ANY(ARRAY(...))`` beside it: PostgreSQL searches such
        # an array row by row, so over E expired jobs it cost E x E comparisons (1 s at
        # 10,000, 293 s at 30,000 for graphile-worker).
        table: sa.ColumnClause[Any] = sa.column("tableoid", _selectable=target)
        ctid: sa.ColumnClause[Any] = sa.column("ctid", _selectable=target)
        narrow = running.with_only_columns(
            running.selected_columns.job_id, expired.label("expired"),
            order.label("scan_key"), table.label("row_table"), ctid.label("row_ctid"))
        read = _kept(narrow.cte("running"))
        chosen = sa.select(read.c.row_table, read.c.row_ctid).where(read.c.expired.is_(True))
        if after is not None:
            chosen = chosen.where(read.c.job_id > after)
        return (running.add_columns(*_totals(read, unheld))
                .where(sa.tuple_(table, ctid).in_(chosen))
                .order_by(order).limit(limit)
                .with_for_update(skip_locked=True, of=target))
    scan = scan.where(read.c.expired.is_(True)).order_by(read.c.scan_key).limit(limit)
    if after is not None:
        scan = scan.where(read.c.job_id > after)
    return scan


def brake_counts(running: sa.Select[Any], expired: sa.ColumnElement[bool],
                 unheld: Unheld) -> sa.Select[Any]:
    """The brake's counts alone (``running_total``, ``expired_total``), for a pass that
    found no expired candidate to read them with."""
    return sa.select(*_totals(running.add_columns(expired.label("expired")).subquery(),
                              unheld))


def _kept(read: sa.CTE) -> sa.CTE:
    """The read, kept once (``MATERIALIZED``) where the engine has the word; MySQL has
    none and chooses for itself."""
    return (read.prefix_with("MATERIALIZED", dialect="postgresql")
            .prefix_with("MATERIALIZED", dialect="sqlite"))


def _totals(read: Any, unheld: Unheld) -> list[sa.Label[Any]]:
    """The brake's counts over the kept read: every row, and the expired unheld ones."""
    counted = sa.select(sa.func.count()).select_from(read)
    return [counted.scalar_subquery().label("running_total"),
            counted.where(read.c.expired.is_(True), unheld(read.c.job_id))
            .scalar_subquery().label("expired_total")]


def held_by_key(conn: Connection, shape: Shape, rows: Sequence[sa.Row[Any]]
                ) -> Sequence[sa.Row[Any]]:
    """The scanned rows a locking transaction holds: on MySQL, the rows found are then
    locked by their key (``FOR UPDATE SKIP LOCKED``), and those another replica holds
    are left out. A locking scan would lock every row InnoDB reads on its way (every
    running job, other replicas' batches among them); by key it locks the batch's rows
    only. A row changed between the read and the lock no longer matches its fence, which
    its swap repeats: it is recorded ``fence_lost``, never overwritten. Elsewhere the
    scan locked them (PostgreSQL) or the transaction holds the write lock (SQLite)."""
    if not rows or conn.dialect.name != MYSQL:
        return rows
    ids = [row.job_id for row in rows]
    found = shape.key.in_(ids) if shape.lock_by is None else shape.lock_by(ids)
    locked = {str(k) for k in conn.execute(
        sa.select(shape.key).select_from(shape.locks).where(found)
        .with_for_update(skip_locked=True)).scalars()}
    return [row for row in rows if str(row.job_id) in locked]
