"""graphile-worker (0.16, 0.17) as a job source: ``_private_jobs`` and its named queues.

- **Running**: ``locked_at`` set; the kind is the task identifier (``_private_tasks``).
- **Owner liveness**: graphile-worker keeps none (no heartbeat; ``locked_by`` names a worker
  pool). The lease is ``locked_at`` plus the kind's ``max_run_seconds``, else the
  system's own 4-hour lock timeout (after which its workers unlock the job themselves).
- **Attempts**: its own: a claim increments ``attempts``, so a running job has used
  ``attempts`` of ``max_attempts``.
- **Fence**: (``locked_at``, ``locked_by``, ``attempts``) and the lease still run out,
  repeated for every row of a batch in one ``UPDATE ... FROM unnest(...)``.
- **Resume**: unlocked as its own stale-lock reset does (``locked_at``, ``locked_by``
  cleared, ``run_at`` no later than now), its named queue unlocked where the same pool
  held it, and its workers nudged on ``jobs:insert``; the next claim counts the attempt.
- **Terminalize**: unlocked the same way, then ``permanently_fail_jobs`` (its own
  function, once over the batch's ids): ``attempts = max_attempts``, ``last_error`` = our
  reason code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as pydantic_dataclass
from sqlalchemy.engine import Connection

from reconciler.config.tables import SourceSettings
from reconciler.core.evidence import StepFacts
from reconciler.core.kinds import KindPolicy
from reconciler.core.ports import Candidate, Fence
from reconciler.core.vocabulary import Disposition, JobStatus
from reconciler.sources.kit.batches import Batch, fence_of
from reconciler.sources.kit.checks import require_schema
from reconciler.sources.kit.declaration import Declaration
from reconciler.sources.kit.fences import ForeignFence
from reconciler.sources.kit.shapes import Shape, candidate, per_kind
from reconciler.sources.kit.system import Changed, Policies, Scope, System
from reconciler.storage.clock import db_now, now_plus, seconds_since
from reconciler.storage.sql import unnest

_STATUS_WORDS = {"locked": JobStatus.PROCESSING, "queued": JobStatus.QUEUED,
                 "failed": JobStatus.FAILED}

LOCK_TIMEOUT_SECONDS = 4 * 3600.0
"""graphile-worker's own stale-lock timeout: its workers unlock jobs locked this long."""


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class GraphileWorkerConfig(SourceSettings):
    """``kind = "graphile-worker"``: graphile-worker's ``_private_jobs`` and queues."""

    kind: ClassVar[str] = "graphile-worker"
    schema: str = "graphile_worker"


@dataclass(frozen=True, slots=True)
class GraphileWorkerFence(ForeignFence):
    """What a graphile-worker swap repeats (the lock and the attempts), the lease it judged
    and the attempt budget it reports."""

    locked_at: datetime
    locked_by: str | None
    attempts: int
    lease_seconds: float
    max_attempts: int


@dataclass(frozen=True, slots=True)
class GraphileWorkerSql:
    """graphile-worker's own SQL over its tables, named by the config."""

    schema: str
    jobs: sa.TableClause
    tasks: sa.TableClause
    queues: sa.TableClause

    @classmethod
    def of(cls, config: GraphileWorkerConfig) -> GraphileWorkerSql:
        """Its tables in the configured schema."""
        schema = config.schema
        return cls(schema, sa.table(
            "_private_jobs", sa.column("id"), sa.column("task_id"), sa.column("job_queue_id"),
            sa.column("locked_at"), sa.column("locked_by"), sa.column("attempts"),
            sa.column("max_attempts"), sa.column("run_at"), sa.column("updated_at"),
            sa.column("created_at"), sa.column("last_error"),
            schema=schema),
            sa.table("_private_tasks", sa.column("id"), sa.column("identifier"),
                     schema=schema),
            sa.table("_private_job_queues", sa.column("id"), sa.column("locked_at"),
                     sa.column("locked_by"), schema=schema))

    def check_schema(self, conn: Connection) -> None:
        """graphile-worker's private tables and its ``permanently_fail_jobs``."""
        require_schema(conn, GraphileWorkerConfig.kind, self.schema, {
            "_private_jobs": ("id", "task_id", "job_queue_id", "locked_at", "locked_by",
                              "attempts", "max_attempts", "run_at", "last_error"),
            "_private_tasks": ("id", "identifier"),
            "_private_job_queues": ("id", "locked_at", "locked_by")},
            ("permanently_fail_jobs",),
            missing_schema=" (has graphile-worker migrated this database?)")

    # -- SQL pieces ---------------------------------------------------------- #

    def _lease_seconds(self, policies: Policies) -> sa.ColumnElement[Any]:
        by_kind = per_kind(self.tasks.c.identifier, {k: p.max_run_seconds
                                                     for k, p in policies.items()})
        return sa.func.coalesce(by_kind, LOCK_TIMEOUT_SECONDS)

    def running(self, scope: Scope, policies: Policies) -> sa.Select[Any]:
        """Every locked job, its claim's age and how far past its lease."""
        jobs, tasks = self.jobs, self.tasks
        claim_age = seconds_since(jobs.c.locked_at)
        return (
            sa.select(jobs.c.id.label("job_id"), tasks.c.identifier.label("job_kind"),
                      jobs.c.locked_at, jobs.c.locked_by, jobs.c.attempts, jobs.c.max_attempts,
                      claim_age.label("claim_age"),
                      (claim_age - self._lease_seconds(policies)).label("lease_expired_seconds"))
            .select_from(jobs.join(tasks, tasks.c.id == jobs.c.task_id))
            .where(jobs.c.locked_at.is_not(None))
        )

    def expired(self, scope: Scope, policies: Policies) -> sa.ColumnElement[bool]:
        """Locked longer than its lease."""
        return self.jobs.c.locked_at < now_plus(-self._lease_seconds(policies))

    @staticmethod
    def candidate(scope: Scope, row: sa.Row[Any], policy: KindPolicy,
                  steps: StepFacts | None, position: bool) -> Candidate:
        """One locked job's facts; its lock and attempts are the fence."""
        lease = policy.max_run_seconds or LOCK_TIMEOUT_SECONDS
        overrun = float(row.claim_age) - lease
        attempts, max_attempts = int(row.attempts), int(row.max_attempts)
        return candidate(
            job_id=int(row.job_id), kind=row.job_kind, policy=policy,
            # The lease and the budget ride along: the swap repeats the one, reports the other.
            fence=Fence(attempts, GraphileWorkerFence(row.locked_at, row.locked_by, attempts,
                                                      lease, max_attempts)),
            attempt_count=attempts, max_attempts=max_attempts,
            lease_live=overrun < 0, lease_expired_seconds=overrun if overrun >= 0 else None,
            steps=steps, position=position,
        )

    # -- for operators ------------------------------------------------------ #

    def listing(self, conn: Connection) -> sa.Select[Any]:
        """Every job graphile-worker still holds (it deletes the ones that succeed)."""
        jobs, tasks = self.jobs, self.tasks
        status = sa.case((jobs.c.locked_at.is_not(None), sa.literal("locked", sa.Text())),
                         (jobs.c.attempts >= jobs.c.max_attempts, sa.literal("failed", sa.Text())),
                         else_=sa.literal("queued", sa.Text()))
        return (
            sa.select(jobs.c.id.label("job_id"), tasks.c.identifier.label("job_kind"),
                      status.label("source_status"), jobs.c.attempts.label("attempts"),
                      jobs.c.max_attempts.label("max_attempts"),
                      jobs.c.last_error.label("reason"), jobs.c.created_at.label("created_at"),
                      jobs.c.updated_at.label("updated_at"),
                      sa.null().label("finished_at"))
            .select_from(jobs.join(tasks, tasks.c.id == jobs.c.task_id)))

    # -- applying ------------------------------------------------------------ #

    def swap(self, scope: Scope, batch: Batch) -> Changed:
        """Unlocked as its own stale-lock reset does, then failed for good by its own
        function (terminalize); one statement each per batch."""
        jobs, queues, conn = self.jobs, self.queues, scope.conn
        fences = [fence_of(change, GraphileWorkerFence) for change in batch.changes]
        seen = unnest("seen", [
            ("id", sa.BigInteger(), [change.decision.job_id for change in batch.changes]),
            ("locked_at", sa.DateTime(timezone=True), [f.locked_at for f in fences]),
            ("locked_by", sa.Text(), [f.locked_by for f in fences]),
            ("attempts", sa.Integer(), [f.attempts for f in fences]),
            ("lease_seconds", sa.Float(), [f.lease_seconds for f in fences])])
        still = (jobs.c.locked_at < now_plus(-seen.c.lease_seconds) if batch.stalled is None
                 else batch.stalled)
        # Unlocked as its own stale-lock reset does; rows whose fence no longer holds are
        # not returned.
        unlocked = conn.execute(
            jobs.update()
            .where(jobs.c.id == seen.c.id, jobs.c.locked_at == seen.c.locked_at,
                   jobs.c.locked_by.is_not_distinct_from(seen.c.locked_by),
                   jobs.c.attempts == seen.c.attempts, still)
            .values(locked_at=None, locked_by=None,
                    run_at=sa.func.greatest(jobs.c.run_at, db_now()), updated_at=db_now())
            .returning(jobs.c.id, jobs.c.job_queue_id, seen.c.locked_by)
        ).all()
        if not unlocked:
            return {}
        held = [row for row in unlocked if row.job_queue_id is not None]
        if held:
            # Each named queue locked by the same pool for these jobs: free it too.
            queue = unnest("queue", [("id", sa.Integer(), [r.job_queue_id for r in held]),
                                     ("locked_by", sa.Text(), [r.locked_by for r in held])])
            conn.execute(queues.update()
                         .where(queues.c.id == queue.c.id,
                                queues.c.locked_by.is_not_distinct_from(queue.c.locked_by))
                         .values(locked_at=None, locked_by=None))
        ids = [row.id for row in unlocked]
        by_id = {change.decision.job_id: fence
                 for change, fence in zip(batch.changes, fences, strict=True)}
        terminal = batch.disposition is Disposition.TERMINALIZE
        if terminal:
            # Now unlocked, the jobs are ones its own function fails (it refuses locked
            # ones), all in one call.
            failed: sa.Function[Any] = sa.Function(
                "permanently_fail_jobs", sa.literal(ids, sa.ARRAY(sa.BigInteger())),
                sa.literal(batch.reason, sa.Text()), packagenames=(self.schema,))
            conn.execute(sa.select(sa.func.count()).select_from(failed))
        for job_id in ids:
            batch.ledger.fence(job_id, by_id[job_id].attempts + 1)
        return {job_id: by_id[job_id].max_attempts if terminal else by_id[job_id].attempts
                for job_id in ids}


def nudge(conn: Connection, changed: Changed) -> None:
    """Its workers listen on ``jobs:insert``: a nudge after the swaps saves them a poll."""
    if changed:
        payload = json.dumps({"r": 0, "count": len(changed)})
        conn.execute(sa.select(sa.func.pg_notify("jobs:insert", payload)))


def declare(config: GraphileWorkerConfig) -> System:
    """graphile-worker's jobs, leased by their kind's ``max_run_seconds`` (else 4 hours)."""
    sql = GraphileWorkerSql.of(config)
    return System(
        shape=Shape(
            key=sql.jobs.c.id, kind=sql.tasks.c.identifier, locks=sql.jobs,
            # Not its primary key's order: a quiet scan reads the locked rows (by the index
            # docs/sources.md suggests, else in one sequential read) instead of walking
            # the key.
            scan_order=sql.jobs.c.id + sa.literal_column("0"),
            # Its task identifiers: every job names one (a foreign key).
            kind_catalogue=sa.select(sql.tasks.c.identifier)),
        running=sql.running, expired=sql.expired, candidate=sql.candidate, swap=sql.swap,
        check_schema=sql.check_schema, listing=sql.listing,
        # graphile-worker keeps no status: locked, failed for good, or waiting to run.
        status_words=_STATUS_WORDS, after_apply=nudge)


DECLARATION = Declaration(GraphileWorkerConfig, declare)
