"""The SQLAlchemy Core adapter: all of the project's SQL lives in this module.

One statement per operation, written once for both engines. Where PostgreSQL and SQLite
differ, a comment says why: PostgreSQL takes row locks with ``FOR UPDATE SKIP LOCKED``;
SQLite serialises writers with ``BEGIN IMMEDIATE`` (see reconciler.storage.engines), so the same
statement without the locking clause is equally atomic there.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.compiler import compiles

from models import (
    JobArtifact,
    JobAttempt,
    JobRun,
    OperatorAction,
    ReconcilerLease,
    ReconciliationDecision,
    ReconciliationPass,
    StepRun,
    WorkerSession,
)
from reconciler import failpoints
from reconciler.core.decisions import Thresholds
from reconciler.core.evidence import PlanStep, parse_plan
from reconciler.core.ports import (
    STORE_CAPABILITY_VERSION,
    CandidateRow,
    ClaimedJob,
    Cursor,
    JobDetail,
    PlannedChange,
    RecordedDecision,
)
from reconciler.core.vocabulary import (
    AttemptOutcome,
    Disposition,
    JobStatus,
    PassOutcome,
    Reason,
    StepState,
    WorkerStatusReason,
)
from reconciler.errors import LeaseLost
from reconciler.storage.clock import db_now, now_plus, seconds_since
from reconciler.storage.engines import is_postgresql, limit_pass_transaction, read_only

jobs: sa.Table = cast(sa.Table, JobRun.__table__)
steps: sa.Table = cast(sa.Table, StepRun.__table__)
attempts: sa.Table = cast(sa.Table, JobAttempt.__table__)
passes: sa.Table = cast(sa.Table, ReconciliationPass.__table__)
decisions: sa.Table = cast(sa.Table, ReconciliationDecision.__table__)
leases: sa.Table = cast(sa.Table, ReconcilerLease.__table__)
sessions: sa.Table = cast(sa.Table, WorkerSession.__table__)
artifacts: sa.Table = cast(sa.Table, JobArtifact.__table__)
actions: sa.Table = cast(sa.Table, OperatorAction.__table__)

WAKE_CHANNEL = "reconciler_jobs"
SINGLETON_RETRIES = 5


def _session_gone() -> sa.ColumnElement[bool]:
    """True when the job's claim belongs to a worker session known to be gone."""
    return sa.exists().where(
        sessions.c.session_id == jobs.c.worker_session_id,
        sessions.c.stopped_at.is_not(None),
    )


def _wake_workers(conn: Connection) -> None:
    # PostgreSQL delivers NOTIFY at commit, so idle workers wake only for committed jobs.
    # SQLite has no such channel; its workers poll.
    if is_postgresql(conn):
        conn.execute(sa.select(sa.func.pg_notify(WAKE_CHANNEL, "")))


def _end_sessions(conn: Connection, session_ids: Sequence[int], reason: str) -> None:
    """Mark sessions gone and expire their claims' leases so the next pass takes them."""
    conn.execute(
        sessions.update()
        .where(sessions.c.session_id.in_(list(session_ids)), sessions.c.stopped_at.is_(None))
        .values(stopped_at=db_now(), stop_reason=reason)
    )
    conn.execute(
        jobs.update()
        .where(jobs.c.worker_session_id.in_(list(session_ids)),
               IN_PROCESSING, jobs.c.lease_expires_at > db_now())
        .values(lease_expires_at=db_now())
    )

PROCESSING = JobStatus.PROCESSING.value
# Partial indexes are declared WHERE job_status = 'processing' (or 'queued'). A bound
# parameter in its place can keep a generic (prepared) plan from proving the index
# applies, so the scans that rely on those indexes spell the status out as a literal.
IN_PROCESSING = jobs.c.job_status == sa.literal_column(f"'{PROCESSING}'")


class StepNotStartedError(ValueError):
    """``finish_step`` for a step this claim never started."""


def _insert(postgres: bool, table: sa.Table) -> Any:
    """The dialect's INSERT, which knows ON CONFLICT on both engines."""
    return (postgresql.insert if postgres else sqlite.insert)(table)


def _for_update(postgres: bool, query: sa.Select[Any], *, lock: bool,
                skip_locked: bool = True) -> sa.Select[Any]:
    # Row locks exist only on PostgreSQL; SQLite's BEGIN IMMEDIATE already excludes writers.
    # Scans (claim, pass) skip rows others hold; a single named row waits for its lock.
    if lock and postgres:
        return query.with_for_update(skip_locked=skip_locked)
    return query


def _evidence_columns() -> tuple[Any, ...]:
    """The facts a decision reads, ages measured by the database clock in the statement."""
    return (
        jobs.c.job_id, jobs.c.claim_generation, jobs.c.attempt_count, jobs.c.max_attempts,
        jobs.c.operator_hold,
        (jobs.c.lease_expires_at > db_now()).label("lease_live"),
        seconds_since(jobs.c.lease_expires_at).label("lease_expired_seconds"),
        seconds_since(jobs.c.last_activity_at).label("activity_age_seconds"),
        # Raw text, so a malformed plan becomes evidence instead of a failed read.
        sa.cast(jobs.c.step_plan, sa.Text).label("plan_text"),
        jobs.c.lease_expires_at,
        _session_gone().label("session_gone"),
    )


def _seconds(name: str) -> sa.BindParameter[float]:
    return sa.bindparam(name, type_=sa.Float())


@dataclass(frozen=True, slots=True)
class _PassStatements:
    """Every statement of a pass, built once per engine kind and locking mode.

    A pass runs every few seconds and most passes find nothing: building the Core
    constructs anew each time cost more than executing them. Built once, with every
    varying value a bound parameter, they also keep their compiled form cached.
    """

    lead: Any
    start_pass: Any
    finished_pass: Any
    silent_sessions: Any
    expired: Any
    expired_after: Any
    wedged: Any
    steps: Any
    swap: Any
    close_attempts: Any
    record_decisions: Any
    finish_pass: Any


@functools.cache
def _pass_statements(postgres: bool, lock: bool) -> _PassStatements:
    columns = _evidence_columns()
    limit = sa.bindparam("batch_limit", type_=sa.Integer())
    expired = (sa.select(*columns).where(IN_PROCESSING, jobs.c.lease_expires_at <= db_now())
               .order_by(jobs.c.lease_expires_at, jobs.c.job_id).limit(limit))
    expired_after = expired.where(
        sa.tuple_(jobs.c.lease_expires_at, jobs.c.job_id)
        > sa.tuple_(sa.bindparam("after_expires_at", type_=jobs.c.lease_expires_at.type),
                    sa.bindparam("after_job_id", type_=sa.BigInteger()))
    )
    wedged = (
        sa.select(*columns)
        .where(IN_PROCESSING,
               jobs.c.last_activity_at <= now_plus(_seconds("wedged_cutoff_seconds")),
               jobs.c.lease_expires_at > db_now())
        .order_by(jobs.c.last_activity_at, jobs.c.job_id)
        .limit(limit)
    )
    finished = {"started_at": db_now(), "finished_at": db_now()}
    return _PassStatements(
        lead=_leadership_statement(postgres),
        start_pass=passes.insert()
        .values(reconciler_instance=sa.bindparam("pass_instance"), started_at=db_now())
        .returning(passes.c.pass_id),
        finished_pass=passes.insert()
        .values(reconciler_instance=sa.bindparam("pass_instance"),
                pass_outcome=sa.bindparam("outcome_value"), **finished)
        .returning(passes.c.pass_id),
        silent_sessions=sa.select(sessions.c.session_id).where(
            sessions.c.stopped_at.is_(None),
            sessions.c.heartbeat_at <= now_plus(_seconds("session_cutoff_seconds")),
        ),
        expired=_for_update(postgres, expired, lock=lock),
        expired_after=_for_update(postgres, expired_after, lock=lock),
        wedged=_for_update(postgres, wedged, lock=lock),
        steps=sa.select(steps.c.job_id, steps.c.step_index, steps.c.step_state,
                        steps.c.failure_retryable)
        .where(_in_batch(postgres, steps.c.job_id)),
        swap=_swap_statement(postgres),
        close_attempts=_close_attempts_statement(postgres),
        record_decisions=_record_decisions_statement(postgres),
        finish_pass=passes.update()
        .where(passes.c.pass_id == sa.bindparam("finished_pass_id"))
        .values(candidates_seen=sa.bindparam("n_candidates"),
                resumed_count=sa.bindparam("n_resumed"),
                terminalized_count=sa.bindparam("n_terminalized"),
                skipped_count=sa.bindparam("n_skipped"),
                finished_at=db_now(), pass_outcome=PassOutcome.OK.value),
    )


def _leadership_statement(postgres: bool) -> Any:
    """Acquire or renew the leader lease (fenced by holder and expiry); the token or no row."""
    table = leases
    stmt = _insert(postgres, table).values(
        lease_name=sa.bindparam("lead_name"), holder_id=sa.bindparam("lead_holder"),
        fencing_token=1, lease_expires_at=now_plus(_seconds("lead_ttl_seconds")),
    )
    excluded = stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=[table.c.lease_name],
        set_={
            "holder_id": excluded.holder_id,
            # A new holder gets a new token; a renewal keeps its own.
            "fencing_token": sa.case(
                (table.c.holder_id == excluded.holder_id, table.c.fencing_token),
                else_=table.c.fencing_token + 1,
            ),
            "lease_expires_at": excluded.lease_expires_at,
        },
        where=sa.or_(table.c.holder_id == excluded.holder_id,
                     table.c.lease_expires_at <= db_now()),
    ).returning(table.c.fencing_token)


def _swap_statement(postgres: bool) -> Any:
    """One UPDATE for the whole batch; each row repeats the evidence its rule relied on.

    Generation and status catch a reclaim or a finish; the time predicates catch a
    heartbeat (which renews the lease without bumping the generation) and progress.
    """
    values = _json_rows(postgres, "planned", PLANNED_COLUMNS)
    still_wedged = sa.and_(
        values.c.is_wedged == 1,
        jobs.c.last_activity_at <= now_plus(_seconds("wedged_cutoff_seconds")),
    )
    still_expired = sa.and_(
        values.c.is_wedged == 0,
        jobs.c.lease_expires_at <= db_now(),
        # Recent activity protects a job only while its worker session may be alive.
        sa.or_(jobs.c.last_activity_at <= now_plus(_seconds("stale_cutoff_seconds")),
               _session_gone()),
    )
    return (
        jobs.update()
        .where(
            jobs.c.job_id == values.c.job_id,
            _unindexed(jobs.c.claim_generation) == values.c.generation_before,
            _unindexed(jobs.c.job_status) == PROCESSING,
            sa.or_(still_wedged, still_expired),
        )
        .values(swap_changes(values))
        .returning(jobs.c.job_id)
    )


def swap_changes(values: Any) -> dict[str, Any]:
    """What the swap writes into a job from its ``planned`` row: the new status, reason and
    resume point, a bumped generation, no lease; a resume is available at once."""
    resume = values.c.is_resume == 1
    return {
        "job_status": values.c.new_status,
        "status_reason": values.c.new_reason,
        "resume_step_index": sa.case((resume, values.c.resume_at),
                                     else_=jobs.c.resume_step_index),
        "claim_generation": jobs.c.claim_generation + 1,
        "lease_token": None, "lease_owner": None, "lease_expires_at": None,
        "available_at": sa.case((resume, db_now()), else_=jobs.c.available_at),
        "finished_at": sa.case((resume, sa.null()), else_=db_now()),
        "updated_at": db_now(),
    }


def _close_attempts_statement(postgres: bool) -> Any:
    """End the attempts whose claims the swap just took away."""
    values = _json_rows(postgres, "ended", ENDED_COLUMNS)
    return (
        attempts.update()
        .where(
            attempts.c.job_id == values.c.job_id,
            attempts.c.claim_generation == values.c.generation,
            attempts.c.ended_at.is_(None),
        )
        .values(ended_at=db_now(), attempt_outcome=values.c.outcome, ended_by="reconciler")
    )


def _record_decisions_statement(postgres: bool) -> Any:
    """Insert a batch's decisions, stamped with the pass and the database's now."""
    source = _json_rows(postgres, "recorded", DECISION_COLUMNS)
    names = [name for name, _ in DECISION_COLUMNS]
    return decisions.insert().from_select(
        ["pass_id", "decided_at", *names],
        sa.select(sa.bindparam("recording_pass_id", type_=sa.BigInteger()), db_now(),
                  *(source.c[name] for name in names)),
    )


def planned_rows(acting: Sequence[PlannedChange]) -> str:
    """The ``planned`` parameter of the swap: what each acting change would write."""
    return _encode([
        {
            "job_id": c.decision.job_id, "generation_before": c.generation_before,
            "new_status": _NEW_STATUS[c.decision.disposition],
            "new_reason": c.decision.reason,
            "resume_at": c.decision.resume_step_index or 0,
            "is_resume": int(c.decision.disposition is Disposition.RESUME),
            "is_wedged": int(c.decision.reason is Reason.WORKER_WEDGED),
        }
        for c in acting
    ])


_NEW_STATUS = {Disposition.RESUME: JobStatus.QUEUED, Disposition.TERMINALIZE: JobStatus.FAILED}


class SqlPassTransaction:
    """One pass's transaction on one connection (see ``store.PassTransaction``)."""

    def __init__(self, conn: Connection, *, lock: bool) -> None:
        self.conn = conn
        self.postgres = is_postgresql(conn)
        self.sql = _pass_statements(self.postgres, lock)

    def take_leadership(self, lease_name: str, holder_id: str, ttl_seconds: float) -> int | None:
        """Acquire or renew the leader lease in this transaction (fenced by holder and expiry)."""
        token = self.conn.execute(self.sql.lead, {
            "lead_name": lease_name, "lead_holder": holder_id, "lead_ttl_seconds": ttl_seconds,
        }).scalar_one_or_none()
        return None if token is None else int(token)

    def start_pass_record(self, instance: str) -> int:
        """Insert this pass's row; outcome and counts are filled in by ``apply``."""
        return int(self.conn.execute(self.sql.start_pass, {"pass_instance": instance})
                   .scalar_one())

    def record_finished_pass(self, instance: str, outcome: PassOutcome) -> int:
        """Insert a pass that decided nothing (not leader, or nothing stale) in one statement."""
        return int(self.conn.execute(self.sql.finished_pass, {
            "pass_instance": instance, "outcome_value": outcome.value,
        }).scalar_one())

    def expire_gone_sessions(self, timeout_seconds: float) -> int:
        """Mark silent worker sessions gone and expire their claims' leases at once."""
        ids = [int(i) for i in self.conn.execute(
            self.sql.silent_sessions, {"session_cutoff_seconds": -timeout_seconds}).scalars()]
        if ids:
            _end_sessions(self.conn, ids, "heartbeat_lost")
        return len(ids)

    def candidates(
        self, limit: int, thresholds: Thresholds, after: Cursor | None
    ) -> list[CandidateRow]:
        """Expired leases first (paged by key), then wedged live leases, within ``limit``."""
        if after is None:
            rows = list(self.conn.execute(self.sql.expired, {"batch_limit": limit}).all())
        else:
            rows = list(self.conn.execute(self.sql.expired_after, {
                "batch_limit": limit, "after_expires_at": after.lease_expires_at,
                "after_job_id": after.job_id,
            }).all())
        if len(rows) < limit:
            rows += self.conn.execute(self.sql.wedged, {
                "batch_limit": limit - len(rows),
                "wedged_cutoff_seconds": -thresholds.wedged_after_seconds,
            }).all()
        return self._with_steps(rows)

    def evidence_for(self, job_ids: Sequence[int]) -> list[CandidateRow]:
        """The same facts for named processing jobs, whatever their lease (for explain)."""
        rows = list(self.conn.execute(
            sa.select(*_evidence_columns())
            .where(jobs.c.job_id.in_(list(job_ids)), jobs.c.job_status == PROCESSING)
            .order_by(jobs.c.job_id)
        ))
        return self._with_steps(rows)

    def _with_steps(self, rows: Sequence[sa.Row[Any]]) -> list[CandidateRow]:
        """Candidate rows with their step records, loaded in one query for the batch."""
        if not rows:
            return []
        step_rows: dict[int, list[tuple[int, str, bool | None]]] = {r[0]: [] for r in rows}
        found = self.conn.execute(
            self.sql.steps, {"batch_ids": _batch_ids(self.postgres, list(step_rows))}).all()
        for job_id, step_index, state, retryable in found:
            step_rows[job_id].append((step_index, state, retryable))
        # Positional unpacking: attribute access on a Row costs more than the rest together.
        return [
            CandidateRow(job_id, generation, attempts, budget, bool(held), bool(live),
                         _float(expired_for), _float(idle_for), plan_text,
                         tuple(step_rows[job_id]), expires_at, bool(gone))
            for (job_id, generation, attempts, budget, held, live, expired_for, idle_for,
                 plan_text, expires_at, gone) in cast(list[tuple[Any, ...]], rows)
        ]

    def apply(
        self, pass_id: int, changes: Sequence[PlannedChange], thresholds: Thresholds
    ) -> list[RecordedDecision]:
        """Compare-and-swap all non-skip changes at once, then record every decision."""
        acting = [c for c in changes if c.decision.disposition is not Disposition.SKIP]
        applied: set[int] = set()
        if acting:
            applied = self._swap(acting, thresholds)
            failpoints.hit("between_apply_and_record")
            self._close_attempts([c for c in acting if c.decision.job_id in applied])
        recorded: list[RecordedDecision] = []
        rows: list[dict[str, Any]] = []
        for change in changes:
            d, before = change.decision, change.generation_before
            if d.disposition is Disposition.SKIP:
                r = RecordedDecision(d.job_id, d.disposition, d.reason, d.resume_step_index,
                                     before, None)
            elif d.job_id in applied:
                r = RecordedDecision(d.job_id, d.disposition, d.reason, d.resume_step_index,
                                     before, before + 1)
            else:
                r = RecordedDecision(d.job_id, Disposition.SKIP, Reason.FENCE_LOST, None,
                                     before, None)
            recorded.append(r)
            rows.append({
                "job_id": r.job_id, "disposition": r.disposition,
                "decision_reason": r.reason, "generation_before": before,
                "generation_after": r.generation_after,
                "resume_step_index": r.resume_step_index,
                "decision_evidence": change.evidence,
            })
        if rows:
            self.conn.execute(self.sql.record_decisions, {
                "recording_pass_id": pass_id, "recorded_rows": _encode(rows)})
        counts = _count(recorded)
        self.conn.execute(self.sql.finish_pass, {
            "finished_pass_id": pass_id, "n_candidates": len(changes),
            "n_resumed": counts[Disposition.RESUME],
            "n_terminalized": counts[Disposition.TERMINALIZE],
            "n_skipped": counts[Disposition.SKIP],
        })
        return recorded

    def _swap(self, acting: Sequence[PlannedChange], thresholds: Thresholds) -> set[int]:
        """Compare-and-swap the acting changes (``_swap_statement``); the job ids swapped."""
        swapped = {int(job_id) for job_id in self.conn.execute(self.sql.swap, {
            "planned_rows": planned_rows(acting),
            "wedged_cutoff_seconds": -thresholds.wedged_after_seconds,
            "stale_cutoff_seconds": -thresholds.stale_after_seconds,
        }).scalars()}
        if swapped and any(c.decision.disposition is Disposition.RESUME for c in acting):
            _wake_workers(self.conn)
        return swapped

    def _close_attempts(self, swapped: Sequence[PlannedChange]) -> None:
        """End the attempts whose claims the swap just took away."""
        if not swapped:
            return
        self.conn.execute(self.sql.close_attempts, {"ended_rows": _encode([
            {
                "job_id": c.decision.job_id, "generation": c.generation_before,
                "outcome": AttemptOutcome.ABANDONED
                if c.decision.reason is Reason.WORKER_WEDGED else AttemptOutcome.LOST,
            }
            for c in swapped
        ])})


PLANNED_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("job_id", sa.BigInteger()), ("generation_before", sa.BigInteger()),
    ("new_status", sa.String()), ("new_reason", sa.String()), ("resume_at", sa.Integer()),
    ("is_resume", sa.Integer()), ("is_wedged", sa.Integer()),
)
ENDED_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("job_id", sa.BigInteger()), ("generation", sa.BigInteger()), ("outcome", sa.String()),
)
DECISION_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("job_id", sa.BigInteger()), ("disposition", sa.String()),
    ("decision_reason", sa.String()), ("generation_before", sa.BigInteger()),
    ("generation_after", sa.BigInteger()), ("resume_step_index", sa.Integer()),
    ("decision_evidence", sa.JSON()),
)


class _unindexed(sa.sql.expression.ColumnElement[Any]):  # noqa: N801 - reads as SQL
    """A column SQLite must not use an index for: ``+column`` (PostgreSQL: the column).

    In ``UPDATE job_runs ... FROM <json rows>``, an index on ``job_status`` tempts SQLite
    to scan every processing job and probe the JSON rows for each; with the index ruled
    out it loops over the batch and finds each job by primary key.
    """

    inherit_cache = True

    def __init__(self, column: sa.ColumnElement[Any]) -> None:
        self.column = column
        self.type = column.type


@compiles(_unindexed, "sqlite")
def _sqlite_unindexed(element: _unindexed, compiler: Any, **kw: Any) -> str:
    return f"+{compiler.process(element.column, **kw)}"


@compiles(_unindexed, "postgresql")
def _pg_unindexed(element: _unindexed, compiler: Any, **kw: Any) -> str:
    return str(compiler.process(element.column, **kw))


_encoder = json.JSONEncoder(separators=(",", ":"))


def _encode(rows: list[dict[str, Any]]) -> str:
    """A batch's rows as the JSON text of one parameter (StrEnum members encode as text)."""
    return _encoder.encode(rows)


def _json_rows(postgres: bool, name: str, columns: Sequence[tuple[str, Any]]) -> Any:
    """A whole batch as one JSON parameter ``<name>_rows``, read back as a table.

    One bind parameter instead of one per value: the statement text stays the same for
    every batch size, so it is compiled once and cached, and a batch of thousands costs
    one round trip. PostgreSQL reads it with ``json_to_recordset`` (``json``, not
    ``jsonb``: nested evidence passes through as text, never converted to binary); SQLite
    with ``json_each`` and ``json_extract`` (which returns nested objects as JSON text).
    """
    payload = sa.bindparam(f"{name}_rows", type_=sa.Text())
    if postgres:
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


def _in_batch(postgres: bool, column: Any) -> Any:
    """``column`` in the batch of ids bound as ``batch_ids`` (see ``_batch_ids``).

    PostgreSQL: ``= ANY(array)``, which an index scan takes directly. SQLite: ``IN`` over
    ``json_each``, which it probes the index with.
    """
    if postgres:
        return column == sa.any_(
            sa.bindparam("batch_ids", type_=postgresql.ARRAY(sa.BigInteger())))
    each = sa.func.json_each(sa.bindparam("batch_ids", type_=sa.Text()))
    return column.in_(sa.select(each.table_valued("value").c.value))


def _batch_ids(postgres: bool, ids: list[int]) -> list[int] | str:
    """The value of ``batch_ids``: an array on PostgreSQL, JSON text on SQLite."""
    return ids if postgres else json.dumps(ids)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _count(recorded: Sequence[RecordedDecision]) -> dict[Disposition, int]:
    counts = dict.fromkeys(Disposition, 0)
    for r in recorded:
        counts[r.disposition] += 1
    return counts


class SqlStore:
    """The store on one SQLAlchemy engine (SQLite or PostgreSQL)."""

    capability_version = STORE_CAPABILITY_VERSION

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # -- the pass ---------------------------------------------------------------------------

    @contextmanager
    def pass_transaction(self, *, dry_run: bool) -> Iterator[SqlPassTransaction]:
        """A transaction for one pass; a dry run reads without locks and rolls back."""
        with self.engine.connect() as conn:
            if dry_run:
                with read_only(conn).begin() as tx:
                    limit_pass_transaction(conn)
                    yield SqlPassTransaction(conn, lock=False)
                    tx.rollback()
            else:
                with conn.begin():
                    limit_pass_transaction(conn)
                    yield SqlPassTransaction(conn, lock=True)

    def record_failed_pass(self, instance: str, error_code: str) -> int:
        """Record a pass that failed before it could record itself."""
        with self.engine.begin() as conn:
            return int(conn.execute(
                passes.insert().values(
                    reconciler_instance=instance, started_at=db_now(), finished_at=db_now(),
                    pass_outcome=PassOutcome.ERROR.value, error_code=error_code,
                ).returning(passes.c.pass_id)
            ).scalar_one())

    def release_leadership(self, lease_name: str, holder_id: str) -> None:
        """Expire the leader lease now if this holder has it, so a successor need not wait."""
        with self.engine.begin() as conn:
            conn.execute(
                leases.update()
                .where(leases.c.lease_name == lease_name, leases.c.holder_id == holder_id)
                .values(lease_expires_at=db_now())
            )

    def try_lead(self, lease_name: str, holder_id: str, ttl_seconds: float) -> int | None:
        """Acquire or renew the leader lease in its own transaction; the token or None."""
        with self.engine.begin() as conn:
            return SqlPassTransaction(conn, lock=True).take_leadership(
                lease_name, holder_id, ttl_seconds)

    def stale_backlog(self) -> tuple[int, float | None]:
        """How many processing jobs have an expired lease, and the oldest one's age."""
        with self.engine.connect() as conn:
            row = read_only(conn).execute(
                sa.select(sa.func.count(), sa.func.max(seconds_since(jobs.c.lease_expires_at)))
                .where(IN_PROCESSING, jobs.c.lease_expires_at <= db_now())
            ).one()
            return int(row[0]), _float(row[1])

    def delete_audit_before(self, days: float, limit: int) -> int:
        """Delete finished passes older than ``days`` with their decisions, at most ``limit``."""
        with self.engine.begin() as conn:
            old = [int(i) for i in conn.execute(
                sa.select(passes.c.pass_id)
                .where(passes.c.started_at < now_plus(-days * 86400.0),
                       passes.c.finished_at.is_not(None))
                .order_by(passes.c.pass_id).limit(limit)
            ).scalars()]
            if not old:
                return 0
            # Explicit, not ON DELETE CASCADE: SQLite enforces that only with foreign_keys on.
            deleted = conn.execute(
                decisions.delete().where(decisions.c.pass_id.in_(old))).rowcount
            conn.execute(passes.delete().where(passes.c.pass_id.in_(old)))
            return int(deleted) + len(old)

    # -- the worker protocol ----------------------------------------------------------------

    def enqueue(
        self,
        job_kind: str,
        plan: Sequence[PlanStep],
        *,
        max_attempts: int,
        idempotency_key: str | None,
        singleton_key: str | None,
        payload: Any,
        connection: Connection | None = None,
    ) -> int:
        """Insert a queued job, or return the job already holding ``idempotency_key``."""
        row = {
            "job_kind": job_kind, "job_status": JobStatus.QUEUED.value,
            "step_plan": [{"step_name": s.step_name, "effect_kind": s.kind.value}
                          for s in plan],
            "max_attempts": max_attempts, "idempotency_key": idempotency_key,
            "singleton_key": singleton_key, "job_payload": payload,
            "available_at": db_now(), "created_at": db_now(), "updated_at": db_now(),
        }
        if connection is not None:
            return self._enqueue_on(connection, row, idempotency_key)
        with self.engine.begin() as conn:
            return self._enqueue_on(conn, row, idempotency_key)

    def _enqueue_on(self, conn: Connection, row: dict[str, Any], key: str | None) -> int:
        stmt = _insert(is_postgresql(conn), jobs).values(**row)
        if key is not None:
            stmt = stmt.on_conflict_do_nothing(index_elements=[jobs.c.idempotency_key])
        job_id = conn.execute(stmt.returning(jobs.c.job_id)).scalar_one_or_none()
        if job_id is not None:
            _wake_workers(conn)
        if job_id is None:
            job_id = conn.execute(
                sa.select(jobs.c.job_id).where(jobs.c.idempotency_key == key)
            ).scalar_one()
        return int(job_id)

    def claim(self, worker: str, lease_seconds: float, kinds: Sequence[str] | None = None,
              session_id: int | None = None) -> ClaimedJob | None:
        """Atomically take the oldest available queued job and start a new attempt on it.

        On PostgreSQL two claims can still race past the singleton check onto two jobs of
        one key; the unique partial index refuses the loser, which then simply tries again.
        """
        for _ in range(SINGLETON_RETRIES):
            try:
                return self._claim_once(worker, lease_seconds, kinds, session_id)
            except sa.exc.IntegrityError as exc:
                if "singleton" not in str(exc.orig):
                    raise
        return None

    def _claim_once(self, worker: str, lease_seconds: float, kinds: Sequence[str] | None,
                    session_id: int | None) -> ClaimedJob | None:
        token = uuid.uuid4().hex
        with self.engine.begin() as conn:
            other = jobs.alias("other")
            pick = (
                sa.select(jobs.c.job_id)
                .where(
                    jobs.c.job_status == sa.literal_column(f"'{JobStatus.QUEUED.value}'"),
                    jobs.c.available_at <= db_now(),
                    jobs.c.operator_hold.is_(False),
                    # A singleton job waits while another job of its key is processing.
                    sa.or_(jobs.c.singleton_key.is_(None), ~sa.exists().where(
                        other.c.singleton_key == jobs.c.singleton_key,
                        other.c.job_status == sa.literal_column(f"'{PROCESSING}'"),
                    )),
                )
                .order_by(jobs.c.available_at, jobs.c.job_id)
                .limit(1)
            )
            if kinds:
                pick = pick.where(jobs.c.job_kind.in_(list(kinds)))
            if session_id is not None:
                # A session already declared gone claims nothing: its claims could not be
                # heartbeated, and the runtime replaces the session on its next beat.
                pick = pick.where(sa.exists().where(sessions.c.session_id == session_id,
                                                    sessions.c.stopped_at.is_(None)))
            pick = _for_update(is_postgresql(conn), pick, lock=True)
            row = conn.execute(
                jobs.update()
                .where(jobs.c.job_id == pick.scalar_subquery(),
                       jobs.c.job_status == JobStatus.QUEUED.value)
                .values(
                    job_status=PROCESSING, status_reason=None,
                    claim_generation=jobs.c.claim_generation + 1,
                    attempt_count=jobs.c.attempt_count + 1,
                    lease_token=token, lease_owner=worker, worker_session_id=session_id,
                    lease_expires_at=now_plus(lease_seconds),
                    claimed_at=db_now(), last_activity_at=db_now(), updated_at=db_now(),
                )
                .returning(
                    jobs.c.job_id, jobs.c.job_kind, jobs.c.claim_generation,
                    jobs.c.attempt_count, jobs.c.max_attempts, jobs.c.resume_step_index,
                    sa.cast(jobs.c.step_plan, sa.Text).label("plan_text"), jobs.c.job_payload,
                )
            ).one_or_none()
            if row is None:
                return None
            conn.execute(attempts.insert().values(
                job_id=row.job_id, claim_generation=row.claim_generation,
                attempt_number=row.attempt_count, lease_owner=worker, claimed_at=db_now(),
            ))
        return ClaimedJob(
            job_id=int(row.job_id), job_kind=row.job_kind,
            claim_generation=int(row.claim_generation), attempt_count=int(row.attempt_count),
            max_attempts=int(row.max_attempts), lease_token=token,
            resume_step_index=int(row.resume_step_index), plan=_plan_specs(row.plan_text),
            payload=row.job_payload,
        )

    def _fence(self, conn: Connection, job_id: int, token: str, *extra: Any,
               **changes: Any) -> sa.Row[Any]:
        """The fenced write every post-claim operation starts with; LeaseLost on no row."""
        row = conn.execute(
            jobs.update()
            .where(jobs.c.job_id == job_id, jobs.c.lease_token == token,
                   jobs.c.job_status == PROCESSING, *extra)
            .values(**changes)
            .returning(jobs.c.claim_generation, jobs.c.attempt_count, jobs.c.max_attempts,
                       sa.cast(jobs.c.step_plan, sa.Text).label("plan_text"))
        ).one_or_none()
        if row is None:
            raise LeaseLost(job_id)
        return row

    def heartbeat(self, job_id: int, token: str, lease_seconds: float) -> None:
        """Renew this claim's lease only; activity does not move (a beat is not progress)."""
        with self.engine.begin() as conn:
            # A gone session's lease was expired on purpose; its beats must not revive it.
            self._fence(conn, job_id, token, ~_session_gone(),
                        lease_expires_at=now_plus(lease_seconds))

    def report_progress(self, job_id: int, token: str) -> None:
        """Record that the handler moved: ``last_activity_at`` becomes now."""
        with self.engine.begin() as conn:
            self._fence(conn, job_id, token, last_activity_at=db_now(), updated_at=db_now())

    def record_step(
        self, job_id: int, token: str, step_index: int, spec: PlanStep, state: StepState,
        *, error_code: str | None = None, retryable: bool | None = None,
    ) -> None:
        """Fenced step record: the job's activity and the step's row move together."""
        with self.engine.begin() as conn:
            fenced = self._fence(conn, job_id, token,
                                 last_activity_at=db_now(), updated_at=db_now())
            generation = fenced.claim_generation
            finished = state in (StepState.SUCCEEDED, StepState.FAILED)
            if state is StepState.SUCCEEDED:
                done = conn.execute(
                    steps.update()
                    .where(steps.c.job_id == job_id, steps.c.step_index == step_index,
                           steps.c.claim_generation == generation,
                           steps.c.step_state.in_([StepState.STARTED.value,
                                                   StepState.WAITING.value]))
                    .values(step_state=state.value, finished_at=db_now(),
                            error_code=None, failure_retryable=None)
                )
                if done.rowcount != 1:
                    conn.rollback()
                    raise StepNotStartedError(
                        f"step {step_index} was not started by this claim")
                return
            stmt = _insert(is_postgresql(conn), steps).values(
                job_id=job_id, step_index=step_index, step_name=spec.step_name,
                effect_kind=spec.kind.value, step_state=state.value,
                claim_generation=generation, started_at=db_now(),
                finished_at=db_now() if finished else None,
                error_code=error_code, failure_retryable=retryable,
            )
            keep_start = state is not StepState.STARTED
            conn.execute(stmt.on_conflict_do_update(
                index_elements=[steps.c.job_id, steps.c.step_index],
                set_={
                    "step_name": stmt.excluded.step_name,
                    "effect_kind": stmt.excluded.effect_kind,
                    "step_state": stmt.excluded.step_state,
                    "claim_generation": stmt.excluded.claim_generation,
                    # A failure or a wait keeps the start time of the same attempt's start.
                    "started_at": sa.case(
                        (sa.and_(sa.literal(keep_start),
                                 steps.c.claim_generation == stmt.excluded.claim_generation),
                         steps.c.started_at),
                        else_=stmt.excluded.started_at,
                    ),
                    "finished_at": stmt.excluded.finished_at,
                    "error_code": stmt.excluded.error_code,
                    "failure_retryable": stmt.excluded.failure_retryable,
                },
            ))

    def complete(self, job_id: int, token: str) -> int:
        """Fenced completion: the job, its attempt and its staged artifacts, together.

        Returns the completing generation, whose artifact files the caller moves into place.
        """
        with self.engine.begin() as conn:
            row = self._fence(
                conn, job_id, token, job_status=JobStatus.COMPLETED.value, status_reason=None,
                lease_token=None, lease_expires_at=None, finished_at=db_now(),
                last_activity_at=db_now(), updated_at=db_now(),
            )
            conn.execute(
                artifacts.update()
                .where(artifacts.c.job_id == job_id,
                       artifacts.c.claim_generation == row.claim_generation,
                       artifacts.c.artifact_state == "staged")
                # settled_at stays empty until the files are in place (see settle_artifacts).
                .values(artifact_state="published")
            )
            self._end_attempt(conn, job_id, row.claim_generation, AttemptOutcome.COMPLETED)
            return int(row.claim_generation)

    def fail(
        self, job_id: int, token: str, error_code: str, *, retryable: bool,
        backoff_seconds: float, backoff_max_seconds: float, status_reason: str | None = None,
    ) -> bool:
        """Fenced failure; requeues with backoff while attempts remain. True when requeued."""
        with self.engine.begin() as conn:
            row = self._fence(conn, job_id, token, last_error_code=error_code,
                              updated_at=db_now())
            requeue = retryable and row.attempt_count < row.max_attempts
            if requeue:
                delay = min(backoff_seconds * 2 ** max(row.attempt_count - 1, 0),
                            backoff_max_seconds)
                self._requeue(conn, job_id, row, available_at=now_plus(delay))
                outcome = AttemptOutcome.RETRYING
            else:
                reason = status_reason or (WorkerStatusReason.RETRIES_EXHAUSTED if retryable
                                           else WorkerStatusReason.JOB_FAILED).value
                conn.execute(jobs.update().where(jobs.c.job_id == job_id).values(
                    job_status=JobStatus.FAILED.value, status_reason=reason,
                    lease_token=None, lease_expires_at=None, finished_at=db_now(),
                ))
                outcome = AttemptOutcome.FAILED
            self._end_attempt(conn, job_id, row.claim_generation, outcome)
            return requeue

    def release(self, job_id: int, token: str) -> None:
        """Fenced graceful release: requeue now, give the attempt back, keep the resume point."""
        with self.engine.begin() as conn:
            row = self._fence(conn, job_id, token, updated_at=db_now(),
                              attempt_count=jobs.c.attempt_count - 1)
            self._requeue(conn, job_id, row, available_at=db_now())
            self._end_attempt(conn, job_id, row.claim_generation, AttemptOutcome.RELEASED)

    def _requeue(self, conn: Connection, job_id: int, fenced: sa.Row[Any],
                 available_at: Any) -> None:
        resume_at = self._first_unfinished(conn, job_id, fenced.plan_text)
        conn.execute(jobs.update().where(jobs.c.job_id == job_id).values(
            job_status=JobStatus.QUEUED.value, status_reason=None,
            lease_token=None, lease_owner=None, lease_expires_at=None,
            available_at=available_at, resume_step_index=resume_at,
        ))

    def _end_attempt(self, conn: Connection, job_id: int, generation: int,
                     outcome: AttemptOutcome) -> None:
        conn.execute(
            attempts.update()
            .where(attempts.c.job_id == job_id, attempts.c.claim_generation == generation,
                   attempts.c.ended_at.is_(None))
            .values(ended_at=db_now(), attempt_outcome=outcome.value, ended_by="worker")
        )

    # -- worker sessions --------------------------------------------------------------------

    def register_session(self, worker_name: str, host_name: str, process_id: int) -> int:
        """Start a session; a live session of the same worker on the same host is replaced."""
        with self.engine.begin() as conn:
            previous = [int(i) for i in conn.execute(
                sa.select(sessions.c.session_id).where(
                    sessions.c.worker_name == worker_name, sessions.c.host_name == host_name,
                    sessions.c.stopped_at.is_(None))
            ).scalars()]
            if previous:
                _end_sessions(conn, previous, "replaced")
            return int(conn.execute(
                sessions.insert().values(
                    worker_name=worker_name, host_name=host_name, process_id=process_id,
                    started_at=db_now(), heartbeat_at=db_now(),
                ).returning(sessions.c.session_id)
            ).scalar_one())

    def heartbeat_session(self, session_id: int) -> bool:
        """Renew a session; False when it was already declared gone."""
        with self.engine.begin() as conn:
            done = conn.execute(
                sessions.update()
                .where(sessions.c.session_id == session_id, sessions.c.stopped_at.is_(None))
                .values(heartbeat_at=db_now())
            )
            return done.rowcount == 1

    def stop_session(self, session_id: int) -> None:
        """End a session on a graceful stop; any claim it still holds expires at once."""
        with self.engine.begin() as conn:
            _end_sessions(conn, [session_id], "stopped")

    # -- artifacts ---------------------------------------------------------------------------

    def stage_artifact(self, job_id: int, token: str, artifact_name: str) -> int:
        """Fenced: record an artifact staged by this claim; returns its generation."""
        with self.engine.begin() as conn:
            row = self._fence(conn, job_id, token, last_activity_at=db_now(),
                              updated_at=db_now())
            stmt = _insert(is_postgresql(conn), artifacts).values(
                job_id=job_id, claim_generation=row.claim_generation,
                artifact_name=artifact_name, artifact_state="staged", staged_at=db_now(),
            )
            conn.execute(stmt.on_conflict_do_update(
                index_elements=[artifacts.c.job_id, artifacts.c.claim_generation,
                                artifacts.c.artifact_name],
                set_={"staged_at": stmt.excluded.staged_at},
            ))
            return int(row.claim_generation)

    def unpublishable_artifacts(self, limit: int) -> list[tuple[int, int, str]]:
        """Staged artifacts that can never be published: their attempt is over."""
        with self.engine.connect() as conn:
            rows = read_only(conn).execute(
                sa.select(artifacts.c.job_id, artifacts.c.claim_generation,
                          artifacts.c.artifact_name)
                .join(jobs, jobs.c.job_id == artifacts.c.job_id)
                .where(artifacts.c.artifact_state == "staged",
                       sa.or_(jobs.c.claim_generation != artifacts.c.claim_generation,
                              jobs.c.job_status != PROCESSING))
                .order_by(artifacts.c.job_id, artifacts.c.claim_generation)
                .limit(limit)
            )
            return [(int(j), int(g), str(n)) for j, g, n in rows]

    def unsettled_published_artifacts(self, limit: int) -> list[tuple[int, int, str]]:
        """Published artifacts whose files were not confirmed moved into place."""
        with self.engine.connect() as conn:
            rows = read_only(conn).execute(
                sa.select(artifacts.c.job_id, artifacts.c.claim_generation,
                          artifacts.c.artifact_name)
                .where(artifacts.c.artifact_state == "published",
                       artifacts.c.settled_at.is_(None))
                .order_by(artifacts.c.job_id).limit(limit)
            )
            return [(int(j), int(g), str(n)) for j, g, n in rows]

    def settle_artifacts(self, job_id: int, generation: int) -> None:
        """Record that a published set's files are in place."""
        with self.engine.begin() as conn:
            conn.execute(
                artifacts.update()
                .where(artifacts.c.job_id == job_id,
                       artifacts.c.claim_generation == generation,
                       artifacts.c.artifact_state == "published",
                       artifacts.c.settled_at.is_(None))
                .values(settled_at=db_now())
            )

    def discard_artifact(self, job_id: int, generation: int, artifact_name: str) -> bool:
        """Mark one stale staged artifact discarded (after its file is gone)."""
        with self.engine.begin() as conn:
            done = conn.execute(
                artifacts.update()
                .where(artifacts.c.job_id == job_id,
                       artifacts.c.claim_generation == generation,
                       artifacts.c.artifact_name == artifact_name,
                       artifacts.c.artifact_state == "staged")
                .values(artifact_state="discarded", settled_at=db_now())
            )
            return done.rowcount == 1

    def published_artifact_names(self, job_id: int, generation: int) -> list[str]:
        """Names in the published set of one generation."""
        with self.engine.connect() as conn:
            return [str(n) for n in read_only(conn).execute(
                sa.select(artifacts.c.artifact_name).where(
                    artifacts.c.job_id == job_id, artifacts.c.claim_generation == generation,
                    artifacts.c.artifact_state == "published")
            ).scalars()]

    def artifacts_of(self, job_id: int) -> list[tuple[int, str, str]]:
        """(generation, name, state) of every artifact of a job."""
        with self.engine.connect() as conn:
            rows = read_only(conn).execute(
                sa.select(artifacts.c.claim_generation, artifacts.c.artifact_name,
                          artifacts.c.artifact_state)
                .where(artifacts.c.job_id == job_id)
                .order_by(artifacts.c.claim_generation, artifacts.c.artifact_name)
            )
            return [(int(g), str(n), str(st)) for g, n, st in rows]

    # -- operator actions --------------------------------------------------------------------

    def operator_action(self, job_id: int, action: str) -> tuple[bool, str | None]:
        """Apply hold, unhold, retry or cancel with the same fences; record it either way.

        Returns (applied, refusal reason). Each change is a compare-and-swap on the status
        (and generation) read in the same transaction.
        """
        with self.engine.begin() as conn:
            current = sa.select(
                jobs.c.job_status, jobs.c.claim_generation, jobs.c.operator_hold,
                sa.cast(jobs.c.step_plan, sa.Text).label("plan_text"),
            ).where(jobs.c.job_id == job_id)
            row = conn.execute(_for_update(is_postgresql(conn), current, lock=True,
                                           skip_locked=False)).one_or_none()
            if row is None:
                return False, "no_such_job"
            status, generation = row.job_status, int(row.claim_generation)
            changes, refusal = _operator_change(action, status, bool(row.operator_hold))
            new_generation = generation
            if changes is not None:
                if action == "retry":
                    changes["resume_step_index"] = self._first_unfinished(
                        conn, job_id, row.plan_text)
                if "claim_generation" in changes:
                    new_generation = generation + 1
                done = conn.execute(
                    jobs.update()
                    .where(jobs.c.job_id == job_id, jobs.c.job_status == status,
                           jobs.c.claim_generation == generation)
                    .values(**changes, updated_at=db_now())
                )
                if done.rowcount != 1:
                    changes, refusal, new_generation = None, "fence_lost", generation
                elif action == "cancel" and status == PROCESSING:
                    conn.execute(
                        attempts.update()
                        .where(attempts.c.job_id == job_id,
                               attempts.c.claim_generation == generation,
                               attempts.c.ended_at.is_(None))
                        .values(ended_at=db_now(), attempt_outcome=AttemptOutcome.LOST.value,
                                ended_by="operator")
                    )
                if action == "retry" and changes is not None:
                    _wake_workers(conn)
            applied = changes is not None
            conn.execute(actions.insert().values(
                job_id=job_id, operator_action=action,
                action_outcome="applied" if applied else "refused", refusal_reason=refusal,
                acted_at=db_now(), status_before=status,
                status_after=changes.get("job_status", status) if changes else status,
                generation_before=generation, generation_after=new_generation,
            ))
            return applied, refusal

    def _first_unfinished(self, conn: Connection, job_id: int, plan_text: str | None) -> int:
        done = set(conn.execute(
            sa.select(steps.c.step_index).where(
                steps.c.job_id == job_id, steps.c.step_state == StepState.SUCCEEDED.value)
        ).scalars())
        plan_length = len(_plan_specs(plan_text))
        return next((i for i in range(plan_length) if i not in done), plan_length)

    # -- public views (the views module decides what is shown) -----------------------------

    def list_jobs(self, status: str | None, limit: int) -> list[JobDetail]:
        """Newest first, optionally of one status."""
        query = sa.select(*_DETAIL_COLUMNS).order_by(jobs.c.job_id.desc()).limit(limit)
        if status is not None:
            query = query.where(jobs.c.job_status == status)
        with self.engine.connect() as conn:
            rows = list(read_only(conn).execute(query))
            states = self._step_states(conn, [r.job_id for r in rows])
        return [_detail(r, states.get(r.job_id, {})) for r in rows]

    def get_job(self, job_id: int) -> JobDetail | None:
        """One job with its step states, or None."""
        with self.engine.connect() as conn:
            row = read_only(conn).execute(
                sa.select(*_DETAIL_COLUMNS).where(jobs.c.job_id == job_id)
            ).one_or_none()
            if row is None:
                return None
            states = self._step_states(conn, [job_id])
        return _detail(row, states.get(job_id, {}))

    def _step_states(self, conn: Connection, job_ids: list[int]) -> dict[int, dict[int, str]]:
        out: dict[int, dict[int, str]] = {}
        if job_ids:
            for job_id, index, state in conn.execute(
                sa.select(steps.c.job_id, steps.c.step_index, steps.c.step_state)
                .where(steps.c.job_id.in_(job_ids))
            ):
                out.setdefault(job_id, {})[index] = state
        return out

    def list_decisions(
        self, reason: str | None, since_seconds: float | None, limit: int
    ) -> list[dict[str, Any]]:
        """Decision records as stored, newest first."""
        query = sa.select(decisions).order_by(decisions.c.decision_id.desc()).limit(limit)
        if reason is not None:
            query = query.where(decisions.c.decision_reason == reason)
        if since_seconds is not None:
            query = query.where(decisions.c.decided_at >= now_plus(-since_seconds))
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in read_only(conn).execute(query)]


_DETAIL_COLUMNS = (
    jobs.c.job_id, jobs.c.job_kind, jobs.c.job_status, jobs.c.status_reason,
    jobs.c.attempt_count, jobs.c.max_attempts, jobs.c.resume_step_index,
    sa.cast(jobs.c.step_plan, sa.Text).label("plan_text"), jobs.c.operator_hold,
    jobs.c.last_error_code, jobs.c.created_at, jobs.c.updated_at, jobs.c.finished_at,
)


def _detail(row: sa.Row[Any], states: dict[int, str]) -> JobDetail:
    return JobDetail(
        job_id=int(row.job_id), job_kind=row.job_kind, job_status=row.job_status,
        status_reason=row.status_reason, attempt_count=row.attempt_count,
        max_attempts=row.max_attempts, resume_step_index=row.resume_step_index,
        plan_text=row.plan_text, operator_hold=bool(row.operator_hold),
        last_error_code=row.last_error_code, created_at=row.created_at,
        updated_at=row.updated_at, finished_at=row.finished_at, step_states=states,
    )


def _plan_specs(plan_text: str | None) -> tuple[PlanStep, ...]:
    """The plan as the client sees it; an unreadable plan gives no steps."""
    return parse_plan(plan_text) or ()


TERMINAL = (JobStatus.COMPLETED.value, JobStatus.FAILED.value, JobStatus.CANCELLED.value)
RETRYABLE_TERMINAL = (JobStatus.FAILED.value, JobStatus.CANCELLED.value)


def _operator_change(action: str, status: str, held: bool
                     ) -> tuple[dict[str, Any] | None, str | None]:
    """The column changes an operator action makes from ``status``, or why it is refused."""
    if action in ("hold", "unhold"):
        if status in TERMINAL:
            return None, "job_terminal"
        if held == (action == "hold"):
            return None, "already_held" if held else "not_held"
        return {"operator_hold": action == "hold"}, None
    if action == "retry":
        if status not in RETRYABLE_TERMINAL:
            # Never rewinds a live job's attempt count; completed work is not redone.
            return None, "job_not_failed_or_cancelled"
        return {
            "job_status": JobStatus.QUEUED.value, "status_reason": "operator_retry",
            "attempt_count": 0, "available_at": db_now(), "finished_at": None,
            "claim_generation": jobs.c.claim_generation + 1,
        }, None
    if action == "cancel":
        if status in TERMINAL:
            return None, "job_terminal"
        # Bumping the generation and dropping the lease fences the worker out at once.
        return {
            "job_status": JobStatus.CANCELLED.value, "status_reason": "operator_cancel",
            "lease_token": None, "lease_expires_at": None, "finished_at": db_now(),
            "claim_generation": jobs.c.claim_generation + 1,
        }, None
    raise ValueError(f"unknown operator action {action!r}")
