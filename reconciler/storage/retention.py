"""Job retention: finished jobs older than ``job_retention_days`` are deleted with their
steps, attempts, artifact records and operator action records, in bounded batches.

Each batch is its own short transaction: it selects at most ``batch_jobs`` finished jobs
from the partial index ``ix_job_runs_finished_at`` oldest first, paging by key
(``(finished_at, job_id)`` after the last batch's last job, never OFFSET), locks them, and
deletes their rows. The delete of ``job_runs`` repeats the evidence (finished status,
``finished_at`` before the cutoff) so a job retried in between is never deleted.

A job whose artifacts the sweep still has to settle (staged, or published but not yet
moved into place) is left for a later run: the sweep finds those through the job's row.
Retention deletes records, never files; published artifacts are the job's output.

The audit (``reconciliation_decisions``) is not touched: it has its own retention and
outlives the jobs it describes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from models.tables import FINISHED_STATUSES
from reconciler.core.job_retention import RetentionReport
from reconciler.core.vocabulary import ArtifactState
from reconciler.storage.clock import now_plus
from reconciler.storage.deadlocks import deadlock_retried
from reconciler.storage.sql import (
    actions,
    artifacts,
    attempts,
    for_update,
    jobs,
    steps,
    unindexed,
)

# The scan's index is ix_job_runs_finished_at (partial: finished_at IS NOT NULL, which
# ``finished_at < cutoff`` implies). Without statistics SQLite would rather probe the
# status index for the three statuses and sort; ``unindexed`` rules that out.
IS_FINISHED = unindexed(jobs.c.job_status).in_([s.value for s in FINISHED_STATUSES])

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True, slots=True)
class RetentionBatch:
    """What one batch deleted, and where the next batch starts (None: nothing left)."""

    jobs_deleted: int
    rows_deleted: int
    next_after: tuple[datetime, int] | None


def _unsettled_artifacts() -> sa.ColumnElement[bool]:
    """The job still has artifacts the sweep must discard or move into place."""
    return sa.exists().where(
        artifacts.c.job_id == jobs.c.job_id,
        sa.or_(artifacts.c.artifact_state == ArtifactState.STAGED.value,
               sa.and_(artifacts.c.artifact_state == ArtifactState.PUBLISHED.value,
                       artifacts.c.settled_at.is_(None))),
    )


def _old_enough(days: float) -> sa.ColumnElement[bool]:
    """The evidence a job may go: finished, and longer ago than ``days``."""
    return sa.and_(IS_FINISHED, jobs.c.finished_at < now_plus(-days * SECONDS_PER_DAY))


def scan_query(days: float, batch_jobs: int,
               after: tuple[datetime, int] | None = None) -> sa.Select[Any]:
    """A batch's scan: old finished jobs the sweep is done with, oldest first, by key."""
    query = (sa.select(jobs.c.job_id, jobs.c.finished_at)
             .where(_old_enough(days), ~_unsettled_artifacts())
             .order_by(jobs.c.finished_at, jobs.c.job_id).limit(batch_jobs))
    if after is not None:
        query = query.where(sa.tuple_(jobs.c.finished_at, jobs.c.job_id) > sa.tuple_(
            sa.literal(after[0], jobs.c.finished_at.type), sa.literal(after[1])))
    return query


def delete_finished_jobs_batch(conn: Connection, days: float, batch_jobs: int,
                               after: tuple[datetime, int] | None = None) -> RetentionBatch:
    """Delete at most ``batch_jobs`` finished jobs older than ``days`` (after ``after``,
    a ``(finished_at, job_id)`` key) with their rows, in the caller's transaction."""
    old_enough = _old_enough(days)
    query = scan_query(days, batch_jobs, after)
    # Locked rows are left for the next run: an operator or a worker is acting on them.
    found = list(conn.execute(for_update(conn.dialect.name, query, lock=True)))
    if not found:
        return RetentionBatch(0, 0, None)
    ids = [int(r.job_id) for r in found]
    # Children first, so their rows are counted (ON DELETE CASCADE would hide them); each
    # delete repeats the evidence that their job is finished and old.
    still_finished = sa.select(jobs.c.job_id).where(jobs.c.job_id.in_(ids), old_enough)
    rows = 0
    for table in (steps, attempts, artifacts, actions):
        rows += int(conn.execute(
            table.delete().where(table.c.job_id.in_(still_finished))).rowcount)
    deleted = int(conn.execute(
        jobs.delete().where(jobs.c.job_id.in_(ids), old_enough)).rowcount)
    last = found[-1]
    next_after = (last.finished_at, int(last.job_id)) if len(found) == batch_jobs else None
    return RetentionBatch(deleted, rows + deleted, next_after)


@deadlock_retried
def _one_batch(engine: Engine, days: float, batch_jobs: int,
               after: tuple[datetime, int] | None) -> RetentionBatch:
    with engine.begin() as conn:
        return delete_finished_jobs_batch(conn, days, batch_jobs, after)


def delete_finished_jobs(engine: Engine, days: float, batch_jobs: int,
                         max_batches: int) -> RetentionReport:
    """One retention run: batches of at most ``batch_jobs`` jobs, each in its own
    transaction, until one comes back short or ``max_batches`` ran."""
    jobs_deleted = rows_deleted = batches = 0
    after: tuple[datetime, int] | None = None
    while batches < max_batches:
        batch = _one_batch(engine, days, batch_jobs, after)
        batches += 1
        jobs_deleted += batch.jobs_deleted
        rows_deleted += batch.rows_deleted
        if batch.next_after is None:
            break
        after = batch.next_after
    return RetentionReport(jobs_deleted, rows_deleted, batches)


class JobRetentionSql:
    """Job retention on one engine (``ports.JobRetention``), the sidecar's chore."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def delete_finished_jobs(self, days: float, batch_jobs: int,
                             max_batches: int) -> RetentionReport:
        """One retention run (see ``delete_finished_jobs``)."""
        return delete_finished_jobs(self.engine, days, batch_jobs, max_batches)
