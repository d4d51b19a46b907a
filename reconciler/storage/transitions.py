"""Where a native job's row changes state: every transition of ``job_runs``, written once.

The worker side (claim, complete, fail, release), the pass (resume and terminalize a
batch, park) and the operator (hold, unhold, retry, cancel) all change a job here, so an
ended job looks the same whoever ended it: no claim left on it (``ENDED``), its attempt
closed (``end_attempt``), and, when it completed, its generation's staged artifacts
published (``publish_generation``).

Every write is fenced: a worker's on (job, lease token, processing), made by the caller's
``fence``; the pass's on (job, claim generation, processing) plus the time predicate of
the rule it applies, on the database clock; the operator's on (job, status, generation)
read in the same transaction. A fence that matches no row changes nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.policy import (
    OperatorChange,
    first_unfinished_step,
    retry_delay_seconds,
)
from reconciler.core.ports import ClaimedJob
from reconciler.core.vocabulary import (
    ArtifactState,
    AttemptOutcome,
    EndedBy,
    JobStatus,
    SessionEndReason,
    StepState,
    WorkerStatusReason,
)
from reconciler.errors import LeaseLost
from reconciler.storage.clock import db_now, now_plus
from reconciler.storage.sql import (
    CLAIM_INDEX,
    IN_PROCESSING,
    IN_QUEUE,
    MYSQL,
    PLAN_TEXT,
    PROCESSING,
    along,
    artifacts,
    attempts,
    for_update,
    in_batch,
    jobs,
    json_rows,
    plan_steps,
    session_gone,
    sessions,
    steps,
    unindexed,
    update_returning,
    wake_workers,
)

# The claim columns a job drops whenever no worker holds it any more.
NO_CLAIM: dict[str, Any] = {
    "lease_token": None, "lease_owner": None, "lease_expires_at": None,
    "worker_session_id": None, "reconcile_parked": False,
}


def end_sessions(conn: Connection, session_ids: Sequence[int],
                 reason: SessionEndReason) -> None:
    """Mark sessions gone and expire their claims' leases so the next pass takes them: a
    job's lease changes here, beside every other change of its row."""
    conn.execute(
        sessions.update()
        .where(sessions.c.session_id.in_(list(session_ids)), sessions.c.stopped_at.is_(None))
        .values(stopped_at=db_now(), stop_reason=reason.value)
    )
    conn.execute(
        jobs.update()
        .where(jobs.c.worker_session_id.in_(list(session_ids)),
               IN_PROCESSING, jobs.c.lease_expires_at > db_now())
        .values(lease_expires_at=db_now())
    )


def ended(status: JobStatus, reason: str | None) -> dict[str, Any]:
    """The columns of a job that ends in ``status``, whoever ends it: no claim left on it,
    finished now."""
    return {"job_status": status.value, "status_reason": reason, **NO_CLAIM,
            "finished_at": db_now(), "updated_at": db_now()}


# -- one job ---------------------------------------------------------------------------------


def _open_attempt(job_id: Any, generation: Any) -> Any:
    return sa.and_(attempts.c.job_id == job_id, attempts.c.claim_generation == generation,
                   attempts.c.ended_at.is_(None))


def _staged_of(job_id: Any, generation: Any) -> Any:
    return sa.and_(artifacts.c.job_id == job_id, artifacts.c.claim_generation == generation,
                   artifacts.c.artifact_state == ArtifactState.STAGED.value)


# settled_at stays empty until the files are in place (the sidecar's artifact sweep).
PUBLISHED = {"artifact_state": ArtifactState.PUBLISHED.value}


@functools.cache
def _single() -> tuple[Any, Any]:
    """End one attempt; publish one generation: built once, every value bound."""
    job_id = sa.bindparam("end_job_id", type_=sa.BigInteger())
    generation = sa.bindparam("end_generation", type_=sa.BigInteger())
    end = (attempts.update().where(_open_attempt(job_id, generation))
           .values(ended_at=db_now(), attempt_outcome=sa.bindparam("end_outcome"),
                   ended_by=sa.bindparam("end_by")))
    publish = artifacts.update().where(_staged_of(job_id, generation)).values(PUBLISHED)
    return end, publish


def end_attempt(conn: Connection, job_id: int, generation: int, outcome: AttemptOutcome,
                ended_by: EndedBy) -> None:
    """Close the attempt of ``generation`` (if still open) with its outcome and its ender."""
    conn.execute(_single()[0], {"end_job_id": job_id, "end_generation": generation,
                                "end_outcome": outcome.value, "end_by": ended_by.value})


def publish_generation(conn: Connection, job_id: int, generation: int) -> None:
    """Publish the artifacts ``generation`` staged: it completed, its output is the job's."""
    conn.execute(_single()[1], {"end_job_id": job_id, "end_generation": generation})


def first_unfinished(conn: Connection, job_id: int, plan_text: str | None) -> int:
    """The step a requeued or retried job resumes at, from its succeeded step records."""
    done = set(conn.execute(
        sa.select(steps.c.step_index).where(
            steps.c.job_id == job_id, steps.c.step_state == StepState.SUCCEEDED.value)
    ).scalars())
    return first_unfinished_step(len(plan_steps(plan_text)), done)


def claim(conn: Connection, worker: str, token: str, *, lease_seconds: float,
          kinds: Sequence[str] | None, session_id: int | None) -> ClaimedJob | None:
    """Take the oldest available queued job for ``worker``: a new generation and attempt."""
    other = jobs.alias("other")
    pick = (
        sa.select(jobs.c.job_id)
        .where(
            IN_QUEUE,
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
    if kinds is not None:
        pick = pick.where(jobs.c.job_kind.in_(list(kinds)))
    if session_id is not None:
        # A session already declared gone claims nothing: its claims could not be
        # heartbeated, and the runtime replaces the session on its next beat.
        pick = pick.where(sa.exists().where(sessions.c.session_id == session_id,
                                            sessions.c.stopped_at.is_(None)))
    pick = for_update(conn.dialect.name, along(pick, CLAIM_INDEX), lock=True)
    picked: Any = pick.scalar_subquery()
    if conn.dialect.name == MYSQL:
        # MySQL refuses a subquery on the table being updated: the job is picked (and
        # locked, SKIP LOCKED) first, in the same transaction.
        picked = conn.execute(pick).scalar_one_or_none()
        if picked is None:
            return None
    rows = update_returning(
        conn,
        jobs.update()
        .where(jobs.c.job_id == picked, jobs.c.job_status == JobStatus.QUEUED.value)
        .values(
            job_status=PROCESSING, status_reason=None,
            claim_generation=jobs.c.claim_generation + 1,
            attempt_count=jobs.c.attempt_count + 1,
            lease_token=token, lease_owner=worker, worker_session_id=session_id,
            lease_expires_at=now_plus(lease_seconds),
            claimed_at=db_now(), last_activity_at=db_now(), updated_at=db_now(),
            reconcile_parked=False,
        ),
        jobs.c.job_id, jobs.c.job_kind, jobs.c.claim_generation,
        jobs.c.attempt_count, jobs.c.max_attempts, jobs.c.resume_step_index,
        PLAN_TEXT, jobs.c.job_payload,
    )
    if not rows:
        return None
    (row,) = rows
    conn.execute(attempts.insert().values(
        job_id=row.job_id, claim_generation=row.claim_generation,
        attempt_number=row.attempt_count, lease_owner=worker, claimed_at=db_now(),
    ))
    return ClaimedJob(
        job_id=int(row.job_id), job_kind=row.job_kind,
        claim_generation=int(row.claim_generation), attempt_count=int(row.attempt_count),
        max_attempts=int(row.max_attempts), lease_token=token,
        resume_step_index=int(row.resume_step_index), plan=plan_steps(row.plan_text),
        payload=row.job_payload,
    )


def fence(conn: Connection, job_id: int, token: str, *extra: Any,
          **changes: Any) -> sa.Row[Any]:
    """The fenced write every post-claim operation starts with; LeaseLost on no row.

    It also unparks the job: a worker's write may open the gate a pass parked it on.
    """
    rows = update_returning(
        conn,
        jobs.update()
        .where(jobs.c.job_id == job_id, jobs.c.lease_token == token,
               jobs.c.job_status == PROCESSING, *extra)
        .values({"reconcile_parked": False, **changes}),
        jobs.c.claim_generation, jobs.c.attempt_count, jobs.c.max_attempts, PLAN_TEXT,
    )
    if not rows:
        raise LeaseLost(job_id)
    return rows[0]


# The columns of a worker's completion, written by its fence.
COMPLETING: dict[str, Any] = {**ended(JobStatus.COMPLETED, None), "last_activity_at": db_now()}


def completed(conn: Connection, job_id: int, generation: int) -> None:
    """What a worker's completion of ``generation`` does beyond the job row (which its fence
    wrote with ``COMPLETING``): that generation's artifacts published, its attempt ended."""
    publish_generation(conn, job_id, generation)
    end_attempt(conn, job_id, generation, AttemptOutcome.COMPLETED, EndedBy.WORKER)


def requeue(conn: Connection, job_id: int, plan_text: str | None, available_at: Any) -> None:
    """Back to the queue at ``available_at``, no claim, resuming at the first unfinished step."""
    conn.execute(jobs.update().where(jobs.c.job_id == job_id).values(
        job_status=JobStatus.QUEUED.value, status_reason=None, **NO_CLAIM,
        available_at=available_at, updated_at=db_now(),
        resume_step_index=first_unfinished(conn, job_id, plan_text),
    ))


def failed(conn: Connection, job_id: int, fenced: sa.Row[Any], *, retryable: bool,
           backoff_seconds: float, backoff_max_seconds: float,
           status_reason: str | None) -> bool:
    """What a worker's failure does after its fence: requeued with backoff while attempts
    remain (True), else ended ``failed``; the attempt ended either way."""
    again = retryable and fenced.attempt_count < fenced.max_attempts
    if again:
        delay = retry_delay_seconds(fenced.attempt_count, backoff_seconds, backoff_max_seconds)
        requeue(conn, job_id, fenced.plan_text, now_plus(delay))
    else:
        reason = status_reason or (WorkerStatusReason.RETRIES_EXHAUSTED if retryable
                                   else WorkerStatusReason.JOB_FAILED).value
        conn.execute(jobs.update().where(jobs.c.job_id == job_id)
                     .values(ended(JobStatus.FAILED, reason)))
    end_attempt(conn, job_id, fenced.claim_generation,
                AttemptOutcome.RETRYING if again else AttemptOutcome.FAILED, EndedBy.WORKER)
    return again


def released(conn: Connection, job_id: int, fenced: sa.Row[Any]) -> None:
    """What a worker's graceful release does after its fence (which gave the attempt back):
    requeued now at the resume point, the attempt ended ``released``."""
    requeue(conn, job_id, fenced.plan_text, db_now())
    end_attempt(conn, job_id, fenced.claim_generation, AttemptOutcome.RELEASED,
                EndedBy.WORKER)


def operator_change(conn: Connection, job_id: int, change: OperatorChange, *,
                    status: JobStatus, generation: int, plan_text: str | None) -> bool:
    """Apply an operator's change, fenced on the status and generation read in the same
    transaction; False when the fence matched nothing. A cancel ends the job like any end
    and closes a running claim's attempt (its worker is fenced out and never says so)."""
    # Whatever an operator changes may end what a pass parked the job on (its hold).
    values: dict[str, Any] = {"updated_at": db_now(), "reconcile_parked": False}
    if change.hold is not None:
        values["operator_hold"] = change.hold
    if change.new_status is JobStatus.QUEUED:
        values.update(job_status=JobStatus.QUEUED.value, status_reason=change.status_reason,
                      finished_at=None)
    elif change.new_status is not None:
        values.update(ended(change.new_status, change.status_reason))
    if change.bumps_generation:
        values["claim_generation"] = jobs.c.claim_generation + 1
    if change.restart_budget:
        values.update(attempt_count=0, available_at=db_now(),
                      resume_step_index=first_unfinished(conn, job_id, plan_text))
    done = conn.execute(
        jobs.update()
        .where(jobs.c.job_id == job_id, jobs.c.job_status == status.value,
               jobs.c.claim_generation == generation)
        .values(values)
    )
    if done.rowcount != 1:
        return False
    if change.drop_lease and status is JobStatus.PROCESSING:
        end_attempt(conn, job_id, generation, AttemptOutcome.LOST, EndedBy.OPERATOR)
    if change.restart_budget:
        wake_workers(conn)
    return True


# -- a pass's batch --------------------------------------------------------------------------
# Each statement takes the whole batch as one JSON parameter (sql.json_rows).

PLANNED_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("job_id", sa.BigInteger()), ("generation_before", sa.BigInteger()),
    ("new_status", sa.String()), ("new_reason", sa.String()), ("resume_at", sa.Integer()),
    ("is_resume", sa.Integer()), ("is_wedged", sa.Integer()),
    ("stale_after", sa.Float()), ("wedged_after", sa.Float()),
)
ENDED_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("job_id", sa.BigInteger()), ("generation", sa.BigInteger()), ("outcome", sa.String()),
)


def by_key(dialect: str, update: Any, column: Any) -> Any:
    """A batch UPDATE; on MySQL its rows also named by key (``in_batch``, bound as
    ``batch_ids``). InnoDB locks every row an UPDATE reads: joined to JSON rows with no
    key list, the optimiser may read every processing job through the status index, and
    each wait on another replica's locked batch is a deadlock (``unindexed`` keeps it off
    that index)."""
    return update.where(in_batch(MYSQL, column)) if dialect == MYSQL else update


def swap_statement(dialect: str) -> Any:
    """Resume or terminalize a batch in one UPDATE; each row repeats the evidence its rule
    relied on. Run through ``update_returning`` for the jobs' ids and new generations.

    Generation and status catch a reclaim or a finish; the time predicates (with each
    row's own thresholds) catch a heartbeat, which renews the lease without bumping the
    generation, and progress.
    """
    values = json_rows(dialect, "planned", PLANNED_COLUMNS)
    still_wedged = sa.and_(
        values.c.is_wedged == 1,
        jobs.c.last_activity_at <= now_plus(-values.c.wedged_after),
    )
    still_expired = sa.and_(
        values.c.is_wedged == 0,
        jobs.c.lease_expires_at <= db_now(),
        # Recent activity protects a job only while its worker session may be alive.
        sa.or_(jobs.c.last_activity_at <= now_plus(-values.c.stale_after), session_gone()),
    )
    return by_key(
        dialect, jobs.update()
        .where(
            jobs.c.job_id == values.c.job_id,
            unindexed(jobs.c.claim_generation) == values.c.generation_before,
            unindexed(jobs.c.job_status) == PROCESSING,
            sa.or_(still_wedged, still_expired),
        )
        .values(swap_changes(values)), jobs.c.job_id)


def swap_changes(values: Any) -> dict[str, Any]:
    """What the swap writes into a job from its ``planned`` row: the new status, reason and
    resume point, a bumped generation, no claim (as every end, ``ended``); a resume is
    available at once, a terminalization finished now."""
    resume = values.c.is_resume == 1
    return {
        "job_status": values.c.new_status,
        "status_reason": values.c.new_reason,
        "resume_step_index": sa.case((resume, values.c.resume_at),
                                     else_=jobs.c.resume_step_index),
        "claim_generation": jobs.c.claim_generation + 1,
        **NO_CLAIM,
        "available_at": sa.case((resume, db_now()), else_=jobs.c.available_at),
        "finished_at": sa.case((resume, sa.null()), else_=db_now()),
        "updated_at": db_now(),
    }


def end_attempts_statement(dialect: str, ended_by: EndedBy = EndedBy.RECONCILER) -> Any:
    """``end_attempt`` for a batch: the attempts whose claims a swap (a pass's, or an
    operator's bulk cancel) just took away."""
    values = json_rows(dialect, "ended", ENDED_COLUMNS)
    return by_key(dialect, attempts.update()
                  .where(_open_attempt(values.c.job_id, values.c.generation))
                  .values(ended_at=db_now(), attempt_outcome=values.c.outcome,
                          ended_by=ended_by.value), attempts.c.job_id)


def publish_statement(dialect: str) -> Any:
    """``publish_generation`` for a batch: recovered completions publish as ``complete()``
    would; the sidecar's sweep moves their files into place."""
    values = json_rows(dialect, "ended", ENDED_COLUMNS)
    return by_key(dialect, artifacts.update().where(
        _staged_of(values.c.job_id, values.c.generation)).values(PUBLISHED), artifacts.c.job_id)


def park_statement(dialect: str) -> Any:
    """Park recorded held or gated jobs, fenced on the generation the pass read; on
    PostgreSQL the scan's row locks keep a worker's unparking write from slipping between."""
    values = json_rows(dialect, "parked", ENDED_COLUMNS[:2])
    return by_key(dialect, jobs.update()
                  .where(jobs.c.job_id == values.c.job_id,
                         unindexed(jobs.c.claim_generation) == values.c.generation,
                         unindexed(jobs.c.job_status) == PROCESSING)
                  .values(reconcile_parked=True), jobs.c.job_id)
