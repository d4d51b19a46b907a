"""The statement that finds a pass's expired candidates and the brake's counts at once.

A recovering pass used to read the running jobs twice, once to find candidates and once
for the brake's counts: a sequential read of the whole job table each time where the
system keeps no index on its claimed jobs. Here one read of the running jobs is kept
(``MATERIALIZED``) and both are taken from it; the candidates' rows are then locked by
their physical address (``tableoid``, ``ctid``: a lookup each, not a second read),
skipping those another replica holds, until the batch is full. A row changed since the
read has another address and is left out, as a row whose fence no longer holds would
be. The counts are subqueries over the kept read, computed once a row is returned: a
quiet pass never pays for them.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa


def expired_scan(running: sa.Select[Any], expired: sa.ColumnElement[bool],
                 order: sa.ColumnElement[Any], target: Any, *, limit: int,
                 after: Any | None, locking: bool) -> sa.Select[Any]:
    """The expired rows of ``running`` (every running job of a reconciled kind, with
    ``job_id`` labelled) after the key ``after``, in ``order``, at most ``limit``, locked
    in ``target`` when ``locking``; each row with ``running_total`` and
    ``expired_total``, the brake's counts."""
    kept = running.add_columns(expired.label("expired"), order.label("scan_key"))
    if locking:
        kept = kept.add_columns(sa.column("tableoid", _selectable=target).label("row_table"),
                                sa.column("ctid", _selectable=target).label("row_ctid"))
    read = kept.cte("running").prefix_with("MATERIALIZED")
    counted = sa.select(sa.func.count()).select_from(read)
    scan = (sa.select(*(read.c[c.name] for c in running.selected_columns),
                      counted.scalar_subquery().label("running_total"),
                      counted.where(read.c.expired.is_(True)).scalar_subquery()
                      .label("expired_total"))
            .select_from(read).where(read.c.expired.is_(True))
            .order_by(read.c.scan_key).limit(limit))
    if after is not None:
        scan = scan.where(read.c.job_id > after)
    if not locking:
        return scan
    return (scan.join(target, sa.and_(
                sa.column("tableoid", _selectable=target) == read.c.row_table,
                sa.column("ctid", _selectable=target) == read.c.row_ctid))
            .with_for_update(skip_locked=True, of=target))
