"""The operator console's reads: every one bounded by an index and a LIMIT.

Each method runs on a connection of its own in a short read-only transaction (a deferred
BEGIN on SQLite, so a reader never takes the write lock a pass needs), and returns the
columns a public view may draw from as plain records; ``reconciler.views`` decides what
is shown. Lists page newest first by ``decision_id`` (keyset, never OFFSET).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from reconciler.core.job_story import JobDetail
from reconciler.core.vocabulary import Reason
from reconciler.storage.audit import read_brake
from reconciler.storage.engines import read_only
from reconciler.storage.job_timeline import native_timeline
from reconciler.storage.native_source import NativeSource
from reconciler.storage.read_views import _DETAIL_COLUMNS, ReadViewsSql, _detail, _step_states
from reconciler.storage.sql import actions, decisions, holds, jobs, passes

# Decision ids follow decided_at up to the few seconds two concurrent passes' inserts can
# interleave: a time filter starts its id range this much earlier, and the exact
# decided_at predicate does the rest.
ID_CLOCK_SKEW_SECONDS = 300.0
# Written as the partial indexes' own predicates, so SQLite matches them to the indexes.
HELD = sa.text("job_runs.operator_hold")
PARKED = sa.text("job_runs.reconcile_parked")

NATIVE = NativeSource.source_name


class ConsoleViewsSql(ReadViewsSql):
    """The console's reads on one engine of its own (see ``reconciler.console.port``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._held = threading.local()

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Run every read inside on one connection and one read-only transaction (a page's
        reads: one pool checkout, one consistent view)."""
        with self._read() as conn, conn.begin():
            self._held.conn = conn
            try:
                yield
            finally:
                self._held.conn = None

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        held: Connection | None = getattr(self._held, "conn", None)
        if held is not None:
            yield held
            return
        with read_only(self.engine.connect()) as conn:
            yield conn

    def now(self) -> tuple[datetime, datetime | None]:
        """The database's now, and when the mass-staleness brake engaged (None: not)."""
        with self._read() as conn:
            since, now = read_brake(conn)
        return now, since

    def recent_passes(self, limit: int) -> list[dict[str, Any]]:
        """The latest passes, newest first."""
        with self._read() as conn:
            return _records(conn.execute(
                sa.select(passes).order_by(passes.c.pass_id.desc()).limit(limit)))

    def reason_counts(self, since: datetime, cap: int) -> tuple[dict[str, int], int]:
        """Decisions per reason since ``since``, each counted up to ``cap``, and how many
        of them shadow passes recorded (up to ``cap``). Counted on the indexes alone (the
        reason index and the shadow index, from the first id since then), so a day of a
        mass outage costs a bounded walk of index entries; one statement."""
        with self._read() as conn:
            # No margin: a chart of a day may be off by the few decisions of a boundary
            # second, and a margin would cost index entries outside the day.
            floor = _first_id_since(conn, since, skew_seconds=0.0)
            if floor is None:
                return {}, 0
            row = conn.execute(_REASON_COUNTS, {"count_floor": floor, "count_cap": cap}).one()
        counts = {reason.value: int(n) for reason, n in zip(Reason, row, strict=False) if n}
        return counts, int(row[-1])

    def decisions(self, *, disposition: str | None, reason: str | None, kind: str | None,
                  source: str | None, since: datetime | None, shadow: bool,
                  before_id: int | None, limit: int) -> list[dict[str, Any]]:
        """Decision records matching every filter given (None: any), shadow ones or real
        ones, newest first, with ids below ``before_id``. ``kind`` is a glob (``*``, ``?``)
        on the kind recorded with the decision (every source's), or on a native job's own
        kind for a decision recorded before kinds were kept; each record carries
        ``job_kind`` (None where neither is known)."""
        query = (sa.select(decisions).order_by(decisions.c.decision_id.desc()).limit(limit)
                 .where(decisions.c.shadow_mode == (sa.true() if shadow else sa.false())))
        if before_id is not None:
            query = query.where(decisions.c.decision_id < before_id)
        if disposition is not None:
            query = query.where(decisions.c.disposition == disposition)
        if reason is not None:
            query = query.where(decisions.c.decision_reason == reason)
        if source is not None:
            query = query.where(decisions.c.job_source == source)
        if kind is not None:
            query = query.where(sa.or_(
                _glob(decisions.c.job_kind, kind),
                sa.and_(decisions.c.job_kind.is_(None), decisions.c.job_source == NATIVE,
                        sa.exists().where(jobs.c.job_id == _native_id(),
                                          _glob(jobs.c.job_kind, kind)))))
        with self._read() as conn:
            if since is not None:
                floor = _first_id_since(conn, since)
                if floor is None:
                    return []
                query = query.where(decisions.c.decision_id >= floor,
                                    decisions.c.decided_at >= since)
            records = _records(conn.execute(query))
            return _with_kinds(conn, records)

    def job_decisions(self, source: str, job_id: str, limit: int) -> list[dict[str, Any]]:
        """One job's decisions (real and shadow), newest first."""
        with self._read() as conn:
            return _records(conn.execute(
                sa.select(decisions)
                .where(decisions.c.job_source == source, decisions.c.job_id == job_id)
                .order_by(decisions.c.decision_id.desc()).limit(limit)))

    def job_actions(self, source: str, job_id: str, limit: int) -> list[dict[str, Any]]:
        """The operator actions recorded on one job of any source (its key as the source
        spells it), newest first, with who acted, the note, and the state before and after
        as the source read it."""
        with self._read() as conn:
            return _records(conn.execute(
                sa.select(actions.c.action_id, actions.c.operator_action,
                          actions.c.action_outcome, actions.c.refusal_reason,
                          actions.c.acted_at, actions.c.state_before, actions.c.state_after,
                          actions.c.acted_by.label("actor"),
                          actions.c.operator_note.label("note"))
                .where(actions.c.job_source == source, actions.c.job_key == job_id)
                .order_by(actions.c.action_id.desc()).limit(limit)))

    def timeline(self, job_id: int, limit: int) -> list[dict[str, Any]]:
        """One of this project's jobs' timeline (``reconciler.core.timeline``)."""
        with self._read() as conn:
            return native_timeline(conn, job_id, limit)

    def held_and_parked(self, limit: int) -> tuple[list[JobDetail], list[JobDetail]]:
        """This project's jobs under an operator hold, and those parked (held or gated,
        recorded, left out of the scans); newest first, each list at most ``limit``."""
        return self._job_list(HELD, limit), self._job_list(PARKED, limit)

    def foreign_holds(self, limit: int) -> list[dict[str, Any]]:
        """The reconciler's own holds on other systems' jobs (``jobs hold`` under a
        foreign source), newest first: source, job key, who held it, since when."""
        with self._read() as conn:
            return [dict(r._mapping) for r in conn.execute(
                sa.select(holds.c.job_source, holds.c.job_key, holds.c.held_by,
                          holds.c.held_at)
                .order_by(holds.c.held_at.desc(), holds.c.job_key).limit(limit))]

    def _job_list(self, predicate: sa.TextClause, limit: int) -> list[JobDetail]:
        with self._read() as conn:
            rows = list(conn.execute(sa.select(*_DETAIL_COLUMNS).where(predicate)
                                     .order_by(jobs.c.job_id.desc()).limit(limit)))
            states = _step_states(conn, [r.job_id for r in rows])
        return [_detail(r, states.get(r.job_id, {})) for r in rows]

    def latest_by_reason(self, reasons: Sequence[str], limit: int) -> list[dict[str, Any]]:
        """The latest real decisions of each reason, newest first (one index range each)."""
        with self._read() as conn:
            found: list[dict[str, Any]] = []
            for reason in reasons:
                found += _records(conn.execute(
                    sa.select(decisions)
                    .where(decisions.c.decision_reason == reason,
                           decisions.c.shadow_mode == sa.false())
                    .order_by(decisions.c.decision_id.desc()).limit(limit)))
            found.sort(key=lambda r: -int(r["decision_id"]))
            return _with_kinds(conn, found[:limit])


def _capped_count(*where: sa.ColumnElement[bool]) -> sa.ScalarSelect[int]:
    return sa.select(sa.func.count()).select_from(
        sa.select(sa.literal(1))
        .where(decisions.c.decision_id >= sa.bindparam("count_floor"), *where)
        .limit(sa.bindparam("count_cap", type_=sa.Integer())).subquery()).scalar_subquery()


# Built once: seventeen capped counts and the shadow count in one statement.
_REASON_COUNTS = sa.select(
    *(_capped_count(decisions.c.decision_reason == reason.value) for reason in Reason),
    _capped_count(decisions.c.shadow_mode == sa.true()))


def _records(result: sa.CursorResult[Any]) -> list[dict[str, Any]]:
    return [dict(row._mapping) for row in result]


def _first_id_since(conn: Connection, since: datetime,
                    skew_seconds: float = ID_CLOCK_SKEW_SECONDS) -> int | None:
    """The lowest decision id a ``decided_at >= since`` filter can match (found on the
    decided_at index, ``skew_seconds`` early), or None when no decision is that recent."""
    earliest = since - timedelta(seconds=skew_seconds)
    floor = conn.execute(
        sa.select(decisions.c.decision_id).where(decisions.c.decided_at >= earliest)
        .order_by(decisions.c.decided_at).limit(1)).scalar_one_or_none()
    if floor is None:
        return None
    if conn.execute(sa.select(decisions.c.decision_id)
                    .where(decisions.c.decided_at >= since).limit(1)).first() is None:
        return None
    return int(floor)


def _native_id() -> sa.ColumnElement[Any]:
    """The audit's text job id as this project's integer key. The CASE keeps PostgreSQL
    from casting another source's id (a UUID) even when it evaluates this first."""
    return sa.case((decisions.c.job_source == NATIVE,
                    sa.cast(decisions.c.job_id, sa.BigInteger)), else_=None)


def _glob(column: sa.ColumnElement[str], pattern: str) -> sa.ColumnElement[bool]:
    """``*`` and ``?`` as in the config's ``[kinds]`` patterns; every other character,
    ``%`` and ``_`` included, matches itself."""
    escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return column.like(escaped.replace("*", "%").replace("?", "_"), escape="\\")


def _with_kinds(conn: Connection, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each record with ``job_kind``: as recorded with the decision; for a native decision
    recorded before kinds were kept, its job's (one lookup by primary key for the page),
    None for a deleted one."""
    unkept = [r for r in records if r.get("job_kind") is None]
    native = {int(r["job_id"]) for r in unkept
              if r["job_source"] == NATIVE and str(r["job_id"]).isdigit()}
    kinds: dict[int, str] = {}
    if native:
        kinds = {int(i): k for i, k in conn.execute(
            sa.select(jobs.c.job_id, jobs.c.job_kind).where(jobs.c.job_id.in_(native)))}
    for record in unkept:
        job_id = str(record["job_id"])
        record["job_kind"] = kinds.get(int(job_id)) if job_id.isdigit() and \
            record["job_source"] == NATIVE else None
    return records
