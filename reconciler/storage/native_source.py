"""The ``native`` job source: this project's own ``job_runs``, as the pass reads and changes it.

Candidates come from indexed scans (expired leases paged by key, then wedged live leases),
their step records in one query per batch, and every decision of a batch is applied in
one compare-and-swap statement that repeats, per row, the evidence its rule relied on.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.decisions import Thresholds
from reconciler.core.policy import lost_in_a_row, reclaimed_attempt_outcome
from reconciler.core.ports import (
    Candidate,
    Cursor,
    Fence,
    JobKey,
    LivenessUnknown,
    PlannedChange,
    StuckCount,
    StuckWork,
)
from reconciler.core.vocabulary import (
    ArtifactState,
    AttemptOutcome,
    Disposition,
    JobStatus,
    Reason,
    SessionEndReason,
    StuckReason,
)
from reconciler.storage import transitions
from reconciler.storage.clock import db_now, now_plus, seconds_since
from reconciler.storage.sql import (
    ACTIVITY_INDEX,
    EXPIRY_INDEX,
    IN_PROCESSING,
    PLAN_TEXT,
    PROCESSING,
    SCANNED,
    along,
    artifacts,
    as_float,
    attempts,
    batch_ids,
    batch_params,
    encode_rows,
    for_update,
    in_batch,
    jobs,
    keyed,
    place_type,
    seconds_param,
    session_gone,
    sessions,
    steps,
    update_returning,
    wake_workers,
)


def evidence_columns(dialect: str) -> tuple[Any, ...]:
    """The facts a decision reads, ages measured by the database clock in the statement,
    and the row's places in the two scans (``place_type``)."""
    place = place_type(dialect)
    return (
        jobs.c.job_id, jobs.c.job_kind, jobs.c.claim_generation, jobs.c.attempt_count,
        jobs.c.max_attempts, jobs.c.operator_hold,
        (jobs.c.lease_expires_at > db_now()).label("lease_live"),
        seconds_since(jobs.c.lease_expires_at).label("lease_expired_seconds"),
        seconds_since(jobs.c.last_activity_at).label("activity_age_seconds"),
        PLAN_TEXT, sa.type_coerce(jobs.c.lease_expires_at, place).label("expires_place"),
        session_gone().label("session_gone"),
        sa.type_coerce(jobs.c.last_activity_at, place).label("activity_place"),
    )


@dataclass(frozen=True, slots=True)
class _Statements:
    """Every statement of the source, built once per engine kind and locking mode.

    A pass runs every few seconds and most passes find nothing: building the Core
    constructs anew each time cost more than executing them. Built once, with every
    varying value a bound parameter, they also keep their compiled form cached.
    """

    silent_sessions: Any
    expired: Any
    expired_after: Any
    wedged: Any
    wedged_after: Any
    records: Any
    swap: Any
    close_attempts: Any
    publish: Any
    park: Any


# What ``_records_statement`` returns each row for: (tag, job id, number, text, text, order).
STEP, ATTEMPT, ARTIFACT = 0, 1, 2


def _records_statement(dialect: str) -> Any:
    """A batch's step records, attempt history (newest first) and artifact states in one
    statement: one round trip instead of three, each part still an index lookup by job."""
    def tagged(tag: int) -> Any:
        return sa.literal_column(str(tag), sa.Integer()).label("tag")

    no_text = sa.cast(sa.null(), sa.String()).label("extra")
    no_order = sa.cast(sa.literal_column("0"), sa.BigInteger()).label("newest")
    retryable = sa.case((steps.c.failure_retryable.is_(True), "t"),
                        (steps.c.failure_retryable.is_(False), "f"))
    records = sa.union_all(
        sa.select(tagged(STEP), steps.c.job_id,
                  sa.cast(steps.c.step_index, sa.BigInteger()).label("number"),
                  steps.c.step_state.label("state"), retryable.label("extra"), no_order)
        .where(in_batch(dialect, steps.c.job_id)),
        sa.select(tagged(ATTEMPT), attempts.c.job_id,
                  sa.cast(attempts.c.attempt_number, sa.BigInteger()).label("number"),
                  attempts.c.attempt_outcome.label("state"), attempts.c.ended_by.label("extra"),
                  attempts.c.claim_generation.label("newest"))
        .where(in_batch(dialect, attempts.c.job_id)),
        sa.select(tagged(ARTIFACT), artifacts.c.job_id,
                  artifacts.c.claim_generation.label("number"),
                  artifacts.c.artifact_state.label("state"), no_text, no_order)
        .where(in_batch(dialect, artifacts.c.job_id)),
    ).subquery("records")
    return sa.select(records).order_by(records.c.tag, records.c.job_id,
                                       records.c.newest.desc())


_RETRYABLE = {"t": True, "f": False, None: None}


def after_row(dialect: str, time_column: Any, name: str) -> Any:
    """Rows after a cursor's (time, job id) in a scan ordered by ``time_column``, job id;
    the time bound as the scan read it (``place_type``)."""
    return (sa.tuple_(time_column, jobs.c.job_id)
            > sa.tuple_(sa.bindparam(name, type_=place_type(dialect)),
                        sa.bindparam("after_job_id", type_=sa.BigInteger())))


def brake_totals(*kinds: Any) -> tuple[Any, Any]:
    """The brake's two counts as columns of the expired scan (``running_total``: every
    processing job; ``stale_total``: the expired, unheld ones the scans read), of the
    kinds ``kinds`` filters: each an index count, evaluated once the scan returns a row
    (a quiet pass never pays for them) and then once. Unbounded, the stale count reads
    no more index entries than the running count beside it."""
    running = (sa.select(sa.func.count()).select_from(jobs).where(IN_PROCESSING, *kinds)
               .correlate(None).scalar_subquery().label("running_total"))
    stale = (sa.select(sa.func.count()).select_from(jobs)
             .where(SCANNED, *kinds, jobs.c.lease_expires_at <= db_now(),
                    jobs.c.operator_hold.is_(False))
             .correlate(None).scalar_subquery().label("stale_total"))
    return running, stale


@functools.cache
def _statements(dialect: str, lock: bool) -> _Statements:
    columns = evidence_columns(dialect)
    limit = sa.bindparam("batch_limit", type_=sa.Integer())
    expired = along(sa.select(*columns, *brake_totals())
                    .where(SCANNED, jobs.c.lease_expires_at <= db_now())
                    .order_by(jobs.c.lease_expires_at, jobs.c.job_id).limit(limit),
                    EXPIRY_INDEX)
    expired_after = expired.where(after_row(dialect, jobs.c.lease_expires_at,
                                             "after_expires_at"))
    wedged = along(
        sa.select(*columns)
        .where(SCANNED,
               jobs.c.last_activity_at <= now_plus(seconds_param("wedged_cutoff_seconds")),
               jobs.c.lease_expires_at > db_now())
        .order_by(jobs.c.last_activity_at, jobs.c.job_id)
        .limit(limit), ACTIVITY_INDEX)
    wedged_after = wedged.where(after_row(dialect, jobs.c.last_activity_at,
                                           "after_activity_at"))
    return _Statements(
        silent_sessions=sa.select(sessions.c.session_id).where(
            sessions.c.stopped_at.is_(None),
            sessions.c.heartbeat_at <= now_plus(seconds_param("session_cutoff_seconds")),
        ),
        expired=for_update(dialect, expired, lock=lock),
        expired_after=for_update(dialect, expired_after, lock=lock),
        wedged=for_update(dialect, wedged, lock=lock),
        wedged_after=for_update(dialect, wedged_after, lock=lock),
        records=_records_statement(dialect),
        swap=transitions.swap_statement(dialect),
        close_attempts=transitions.end_attempts_statement(dialect),
        publish=transitions.publish_statement(dialect),
        park=transitions.park_statement(dialect),
    )


def _text(status: JobStatus | None) -> str | None:
    return None if status is None else str(status)  # its value, at a fifth of .value


def planned_rows(acting: Sequence[PlannedChange]) -> str:
    """The ``planned`` parameter of the swap: what each acting change would write."""
    return encode_rows([
        {
            "job_id": c.decision.job_id, "generation_before": c.generation_before,
            # Plain text: the JSON encoder takes a StrEnum member at twice a str's cost.
            "new_status": _text(c.decision.status_after),
            "new_reason": str(c.decision.reason),
            "resume_at": c.decision.resume_step_index or 0,
            "is_resume": int(c.decision.disposition is Disposition.RESUME),
            "is_wedged": int(c.decision.reason is Reason.WORKER_WEDGED),
            "stale_after": c.thresholds.stale_after_seconds,
            "wedged_after": c.thresholds.wedged_after_seconds,
        }
        for c in acting
    ])


class NativeSource:
    """This project's own jobs as a job source, on one connection (see ``ports.JobSource``)."""

    source_name = "native"

    def __init__(self, conn: Connection, *, lock: bool) -> None:
        self.conn = conn
        self.dialect = conn.dialect.name
        self.sql = _statements(self.dialect, lock)
        self._kinds_read: dict[str, str] = {}
        # (running, stale) as the expired scan counted them in this transaction.
        self._brake_counts: tuple[int, int] | None = None

    def expire_gone_owners(self, timeout_seconds: float) -> int:
        """Mark silent worker sessions gone and expire their claims' leases at once."""
        ids = [int(i) for i in self.conn.execute(
            self.sql.silent_sessions, {"session_cutoff_seconds": -timeout_seconds}).scalars()]
        if ids:
            transitions.end_sessions(self.conn, ids, SessionEndReason.HEARTBEAT_LOST)
        return len(ids)

    def candidates(
        self, limit: int, thresholds: Thresholds, after: Cursor | None
    ) -> list[Candidate]:
        """Expired leases first, then wedged live leases, within ``limit``; each scan paged
        by key after the cursor's place in it."""
        if after is None or after.position is None:
            rows = list(self.conn.execute(self.sql.expired, {"batch_limit": limit}).all())
        else:
            expires_at, job_id = after.position
            rows = list(self.conn.execute(self.sql.expired_after, {
                "batch_limit": limit, "after_expires_at": expires_at, "after_job_id": job_id,
            }).all())
        self.counted(rows)
        if len(rows) < limit:
            wedged = {"batch_limit": limit - len(rows),
                      "wedged_cutoff_seconds": -thresholds.wedged_after_seconds}
            if after is None or after.wedged is None:
                rows += self.conn.execute(self.sql.wedged, wedged).all()
            else:
                activity_at, job_id = after.wedged
                rows += self.conn.execute(self.sql.wedged_after, {
                    **wedged, "after_activity_at": activity_at, "after_job_id": job_id}).all()
        return self._with_steps(rows)

    def evidence_for(self, job_ids: Sequence[JobKey]) -> list[Candidate]:
        """The same facts for named processing jobs, whatever their lease (for explain)."""
        rows = list(self.conn.execute(
            sa.select(*evidence_columns(self.dialect))
            .where(jobs.c.job_id.in_([int(i) for i in job_ids]),
                   jobs.c.job_status == PROCESSING)
            .order_by(jobs.c.job_id)
        ))
        return self._with_steps(rows)

    def _with_steps(self, rows: Sequence[sa.Row[Any]]) -> list[Candidate]:
        """Candidates with their step records, attempt history and artifact states, each
        loaded in one query for the whole batch."""
        if not rows:
            return []
        step_rows: dict[int, list[tuple[int, str, bool | None]]] = {r[0]: [] for r in rows}
        history: dict[int, list[tuple[int, str | None, str | None]]] = defaultdict(list)
        unstaged: set[tuple[int, int]] = set()
        ids = {"batch_ids": batch_ids(self.dialect, list(step_rows))}
        # Fetched whole: row by row, psycopg's fetchone costs about 4 us a job.
        for tag, job_id, number, state, extra, _newest in self.conn.execute(
                self.sql.records, ids).all():
            if tag == STEP:
                step_rows[job_id].append((number, state, _RETRYABLE[extra]))
            elif tag == ATTEMPT:
                history[job_id].append((number, state, extra))
            elif state != ArtifactState.STAGED.value:
                unstaged.add((job_id, number))
        self._kinds_read.update((str(job_id), kind) for job_id, kind, *_
                                in cast(list[tuple[Any, ...]], rows))
        # Positional unpacking: attribute access on a Row costs more than the rest together.
        return [
            Candidate(job_id, kind, Fence(generation), attempts_used, budget, bool(held),
                      bool(live), as_float(expired_for), as_float(idle_for), plan_text,
                      tuple(step_rows[job_id]), bool(gone),
                      Cursor(None, (active_at, job_id)) if live
                      else Cursor((expires_at, job_id)),
                      lost_in_a_row(history[job_id]),
                      # Only a completion that publishes nothing else than its own staged
                      # set is a status flip plus publishing, safe to do again.
                      (job_id, generation) not in unstaged)
            for (job_id, kind, generation, attempts_used, budget, held, live, expired_for,
                 idle_for, plan_text, expires_at, gone, active_at, *_counts)
            in cast(list[tuple[Any, ...]], rows)
        ]

    def apply(self, changes: Sequence[PlannedChange]) -> dict[JobKey, int | None]:
        """Compare-and-swap the whole batch in one statement, then end the attempts whose
        claims it took away; the jobs changed with their new generation."""
        self._brake_counts = None  # the brake's counts are of the jobs before the swap
        if not changes:
            return {}
        swapped = self._swap(changes)
        if not swapped:
            return swapped
        if any(c.decision.disposition is Disposition.RESUME for c in changes):
            wake_workers(self.conn)
        self.conn.execute(self.sql.close_attempts, batch_params(self.dialect, "ended_rows", [
            {"job_id": c.decision.job_id, "generation": c.generation_before,
             "outcome": reclaimed_attempt_outcome(c.decision.reason)}
            for c in changes if c.decision.job_id in swapped
        ]))
        recovered = [{"job_id": c.decision.job_id, "generation": c.generation_before,
                      "outcome": AttemptOutcome.COMPLETED}
                     for c in changes if c.decision.job_id in swapped
                     and c.decision.reason is Reason.COMPLETION_RECOVERED]
        if recovered:
            self.conn.execute(self.sql.publish, batch_params(self.dialect, "ended_rows", recovered))
        return swapped

    def park(self, skipped: Sequence[PlannedChange]) -> int:
        """Leave recorded held or gated jobs out of the scans until a worker write, an
        operator action or a decision clears the mark (see ``ports.JobSource.park``)."""
        return int(self.conn.execute(self.sql.park, batch_params(self.dialect, "parked_rows", [
            {"job_id": c.decision.job_id, "generation": c.generation_before}
            for c in skipped])).rowcount)

    def _swap(self, changes: Sequence[PlannedChange]) -> dict[JobKey, int | None]:
        """The batch's compare-and-swap (``transitions.swap_statement``): changed jobs, new
        generation."""
        return {int(row.job_id): int(row.claim_generation) for row in update_returning(
            self.conn, self.sql.swap, jobs.c.job_id, jobs.c.claim_generation,
            params=keyed(self.dialect, {"planned_rows": planned_rows(changes)},
                         [c.decision.job_id for c in changes]))}


    def kind_read(self, job_id: JobKey) -> str | None:
        """The kind of a job this transaction's scans read (None: none read)."""
        return self._kinds_read.get(str(job_id))

    def running_kinds(self) -> list[str]:
        """The kinds of the processing jobs, each once, sorted."""
        return sorted(self.conn.execute(
            sa.select(jobs.c.job_kind).where(IN_PROCESSING).distinct()).scalars())

    def counted(self, expired: Sequence[sa.Row[Any]]) -> None:
        """Keep the brake's counts the expired scan's rows carry (``brake_totals``)."""
        if expired:
            self._brake_counts = (int(expired[0].running_total), int(expired[0].stale_total))

    def running_count(self) -> int:
        """Every processing job, as the expired scan counted it; else (no expired
        candidate this transaction) counted now, through the processing indexes."""
        if self._brake_counts is not None:
            return self._brake_counts[0]
        return int(self.conn.execute(sa.select(sa.func.count()).where(IN_PROCESSING))
                   .scalar_one())

    def stale_count(self, limit: int) -> int:
        """Expired, unheld processing jobs, up to ``limit``, as the expired scan counted
        them; else counted now (a bounded index range)."""
        if self._brake_counts is not None:
            return min(self._brake_counts[1], limit)
        stale = sa.select(jobs.c.job_id).where(
            SCANNED, jobs.c.lease_expires_at <= db_now(),
            jobs.c.operator_hold.is_(False)).limit(limit).subquery()
        return int(self.conn.execute(sa.select(sa.func.count()).select_from(stale))
                   .scalar_one())

    def stuck_work(self, *kinds: Any) -> StuckWork:
        """Processing jobs with an expired lease (of reconciled kinds, where ``kinds``
        filters them): held and parked ones by their hold or gate, the rest awaiting a
        decision; each reason's oldest expiry. The scanned rows are read through the scans'
        partial index, the held and parked ones (few) through theirs."""
        expired = (jobs.c.lease_expires_at <= db_now(), *kinds)
        age = sa.func.max(seconds_since(jobs.c.lease_expires_at))
        # A hold set since the last pass (not parked yet) counts as a hold, not twice.
        count, oldest = self.conn.execute(
            sa.select(sa.func.count(), age).where(SCANNED, jobs.c.operator_hold.is_(False),
                                                  *expired)).one()
        work: StuckWork = {StuckReason.AWAITING_DECISION: StuckCount(int(count),
                                                                     as_float(oldest)),
                           StuckReason.OPERATOR_HOLD: StuckCount(0),
                           StuckReason.WAITING_ON_GATE: StuckCount(0)}
        held = sa.case((jobs.c.operator_hold, StuckReason.OPERATOR_HOLD.value),
                       else_=StuckReason.WAITING_ON_GATE.value).label("reason")
        for reason, n, oldest in self.conn.execute(
                sa.select(held, sa.func.count(), age)
                .where(IN_PROCESSING, sa.or_(jobs.c.operator_hold, jobs.c.reconcile_parked),
                       *expired).group_by(held)):
            work[StuckReason(reason)] = StuckCount(int(n), as_float(oldest))
        return work

    def liveness_unknown(self) -> LivenessUnknown | None:
        """None: worker sessions and leases live in the same database as the jobs."""
        return None

    def leases_own(self) -> bool:
        """True: every claim takes a lease."""
        return True
