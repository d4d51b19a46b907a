"""Procrastinate (3.x) as a job source: its own tables, heartbeats and SQL functions.

- **Running**: ``procrastinate_jobs.status = 'doing'``; the kind is ``task_name``.
- **Owner liveness**: the job's ``worker_id`` row in ``procrastinate_workers``. A row that is
  gone (``worker_id`` NULL: Procrastinate deletes the rows of workers that stop or that a
  starting worker prunes) or whose ``last_heartbeat`` is older than
  ``session_timeout_seconds`` is a gone owner, and the job is a candidate at once. A live
  owner is never second-guessed by time (``max_run_seconds`` is not used here).
- **Attempts**: ``attempts`` counts finished attempts, so a running job has used
  ``attempts + 1``. Procrastinate keeps no budget in the database: ``max_attempts`` comes
  from ``[kinds]`` (else ``default_max_attempts``).
- **Fence**: (``status = 'doing'``, ``worker_id``, ``attempts``) and the owner still gone,
  checked under a row lock in the statement that then writes each row still as decided
  (one ``UPDATE`` per batch, over the batch's snapshots).
- **Resume**: what ``procrastinate_retry_job_v2(id, NULL, ...)`` writes, for the batch at
  once: ``todo``, runnable now, ``attempts + 1``; a ``deferred_for_retry`` event from its
  own trigger. A job with an abort requested is failed instead, as that function does.
- **Terminalize**: what ``procrastinate_finish_job_v1(id, 'failed', false)`` writes:
  ``failed``, ``attempts + 1``, a ``failed`` event. Procrastinate has no error column: our
  reason is in the audit trail only.

Its functions update one job per call (a lookup, a lock and a plpgsql call each: three to
five times the time of the batch's one ``UPDATE``, measured at a thousand jobs); that
``UPDATE`` writes the same columns, and its triggers record the same events.
Its schema check requires the two functions: the schema version whose writes these are.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import sqlalchemy as sa
from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as pydantic_dataclass
from sqlalchemy.dialects.postgresql import ENUM
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
from reconciler.sources.kit.shapes import Shape, candidate, constant
from reconciler.sources.kit.system import Changed, Policies, Scope, System
from reconciler.storage.clock import now_plus, seconds_since
from reconciler.storage.sql import unnest

_STATUS_WORDS = {"todo": JobStatus.QUEUED, "doing": JobStatus.PROCESSING,
                 "succeeded": JobStatus.COMPLETED, "failed": JobStatus.FAILED,
                 "cancelled": JobStatus.CANCELLED, "aborting": JobStatus.PROCESSING,
                 "aborted": JobStatus.CANCELLED}

RETRY_FUNCTION = "procrastinate_retry_job_v2"
FINISH_FUNCTION = "procrastinate_finish_job_v1"


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class ProcrastinateConfig(SourceSettings):
    """``kind = "procrastinate"``: Procrastinate's ``procrastinate_jobs`` and workers."""

    kind: ClassVar[str] = "procrastinate"
    from_settings: ClassVar[frozenset[str]] = frozenset({"session_timeout_seconds"})
    schema: str | None = None
    """Where Procrastinate's tables and functions live; None: the connection's search path."""
    session_timeout_seconds: float = 30.0
    """A worker row silent this long is a gone owner (the ``session_timeout_seconds``
    setting; Procrastinate's own default stalled-worker timeout is also 30 s)."""


@dataclass(frozen=True, slots=True)
class ProcrastinateFence(ForeignFence):
    """What a Procrastinate swap repeats: the owner row and the finished attempts."""

    worker_id: int | None
    attempts: int


@dataclass(frozen=True, slots=True)
class ProcrastinateSql:
    """Procrastinate's own SQL over its tables, named by the config."""

    schema: str | None
    timeout: float
    jobs: sa.TableClause
    workers: sa.TableClause
    status_type: ENUM

    @classmethod
    def of(cls, config: ProcrastinateConfig) -> ProcrastinateSql:
        """Its tables in the configured schema, and its workers' silence allowed."""
        schema = config.schema
        return cls(
            schema, float(config.session_timeout_seconds),
            sa.table("procrastinate_jobs", sa.column("id"), sa.column("task_name"),
                     sa.column("status"), sa.column("attempts"), sa.column("worker_id"),
                     sa.column("abort_requested"), sa.column("scheduled_at"), schema=schema),
            sa.table("procrastinate_workers", sa.column("id"), sa.column("last_heartbeat"),
                     schema=schema),
            ENUM(*_STATUS_WORDS, name="procrastinate_job_status", schema=schema,
                 create_type=False))

    def check_schema(self, conn: Connection) -> None:
        """Procrastinate's tables, columns and the two functions whose writes this source
        repeats set-wise (the schema version it was written against)."""
        require_schema(conn, ProcrastinateConfig.kind, self.schema, {
            "procrastinate_jobs": ("id", "task_name", "status", "attempts", "worker_id",
                                   "abort_requested", "scheduled_at"),
            "procrastinate_workers": ("id", "last_heartbeat")},
            (RETRY_FUNCTION, FINISH_FUNCTION))

    # -- SQL pieces ---------------------------------------------------------- #

    def _owner_gone(self) -> sa.ColumnElement[bool]:
        workers = self.workers
        return sa.or_(workers.c.id.is_(None),
                      workers.c.last_heartbeat < now_plus(-self.timeout))

    def running(self, scope: Scope, policies: Policies) -> sa.Select[Any]:
        """Every ``doing`` job with its worker's heartbeat."""
        jobs, workers = self.jobs, self.workers
        heartbeat_age = seconds_since(workers.c.last_heartbeat)
        return (
            sa.select(jobs.c.id.label("job_id"), jobs.c.task_name.label("job_kind"),
                      jobs.c.attempts, jobs.c.worker_id,
                      workers.c.id.label("worker_row"),
                      self._owner_gone().label("owner_gone"),
                      (heartbeat_age - self.timeout).label("lease_expired_seconds"))
            .select_from(jobs.outerjoin(workers, workers.c.id == jobs.c.worker_id))
            .where(jobs.c.status == constant("doing"))
        )

    def expired(self, scope: Scope, policies: Policies) -> sa.ColumnElement[bool]:
        """Its worker's row gone or silent past the timeout."""
        return self._owner_gone()

    @staticmethod
    def candidate(scope: Scope, row: sa.Row[Any], policy: KindPolicy,
                  steps: StepFacts | None, position: bool) -> Candidate:
        """One ``doing`` job's facts; its worker and finished attempts are the fence."""
        gone = bool(row.owner_gone)
        expired = row.lease_expired_seconds
        return candidate(
            job_id=int(row.job_id), kind=row.job_kind, policy=policy,
            fence=Fence(int(row.attempts), ProcrastinateFence(row.worker_id, int(row.attempts))),
            attempt_count=int(row.attempts) + 1, max_attempts=policy.max_attempts,
            lease_live=not gone,
            lease_expired_seconds=float(expired) if gone and expired is not None else None,
            steps=steps, session_gone=gone, position=position,
        )

    # -- for operators ------------------------------------------------------ #

    def listing(self, conn: Connection) -> sa.Select[Any]:
        """Every Procrastinate job (it keeps no times on the job row)."""
        jobs = self.jobs
        running = sa.case((jobs.c.status == constant("doing"), 1), else_=0)
        return sa.select(
            jobs.c.id.label("job_id"), jobs.c.task_name.label("job_kind"),
            sa.cast(jobs.c.status, sa.Text()).label("source_status"),
            (jobs.c.attempts + running).label("attempts"), sa.null().label("max_attempts"),
            sa.null().label("reason"), sa.null().label("created_at"),
            sa.null().label("updated_at"), sa.null().label("finished_at"))

    # -- applying ------------------------------------------------------------ #

    def swap(self, scope: Scope, batch: Batch) -> Changed:
        """What its retry or finish function writes, for the batch's rows still as
        decided, in one statement."""
        jobs, workers = self.jobs, self.workers
        fences = [fence_of(change, ProcrastinateFence) for change in batch.changes]
        seen = unnest("seen", [
            ("id", sa.BigInteger(), [change.decision.job_id for change in batch.changes]),
            ("worker_id", sa.BigInteger(), [fence.worker_id for fence in fences]),
            ("attempts", sa.Integer(), [fence.attempts for fence in fences])])
        still = self._owner_gone() if batch.stalled is None else batch.stalled
        # Every row still as decided, locked in id order; rows whose fence no longer holds
        # are not returned.
        fenced = (
            sa.select(jobs.c.id)
            .select_from(jobs.join(seen, seen.c.id == jobs.c.id)
                         .outerjoin(workers, workers.c.id == jobs.c.worker_id))
            .where(jobs.c.status == constant("doing"),
                   jobs.c.worker_id.is_not_distinct_from(seen.c.worker_id),
                   jobs.c.attempts == seen.c.attempts, still)
            .order_by(jobs.c.id).with_for_update(of=jobs).subquery("fenced"))
        # What its own function writes, for every locked row in one statement: its
        # triggers record the events as for the function's own UPDATE.
        values = (self._retried() if batch.disposition is Disposition.RESUME
                  else self._failed())
        with self._search_path(scope.conn):  # its triggers name its tables unqualified
            after = {row.id: int(row.attempts) for row in scope.conn.execute(
                jobs.update().where(jobs.c.id == fenced.c.id).values(values)
                .returning(jobs.c.id, jobs.c.attempts))}
        before = {change.decision.job_id: fence.attempts
                  for change, fence in zip(batch.changes, fences, strict=True)}
        for job_id in after:
            batch.ledger.fence(job_id, before[job_id] + 1)
        return dict(after)

    def _retried(self) -> dict[str, Any]:
        """``procrastinate_retry_job_v2(id, NULL, NULL, NULL, NULL)`` of a running job:
        ``todo``, runnable now, one more attempt; a job with an abort requested is failed
        instead and keeps its attempts."""
        jobs = self.jobs
        aborting = jobs.c.abort_requested.is_(True)
        return {"status": sa.cast(sa.case((aborting, constant("failed")),
                                          else_=constant("todo")), self.status_type),
                "attempts": sa.case((aborting, jobs.c.attempts), else_=jobs.c.attempts + 1),
                "scheduled_at": sa.case((aborting, jobs.c.scheduled_at), else_=sa.null())}

    def _failed(self) -> dict[str, Any]:
        """``procrastinate_finish_job_v1(id, 'failed', false)`` of a running job."""
        jobs = self.jobs
        return {"status": constant("failed"), "abort_requested": False,
                "attempts": jobs.c.attempts + 1}

    @contextmanager
    def _search_path(self, conn: Connection) -> Iterator[None]:
        """Procrastinate's trigger functions name its tables unqualified: put its schema
        first in the search path for the swap, then restore the transaction's own path."""
        if self.schema is None:
            yield
            return
        first = f"{conn.dialect.identifier_preparer.quote_identifier(self.schema)}, "
        # Read and set in one statement: the path set is ours, then the previous one.
        path = conn.execute(sa.select(sa.func.set_config(
            "search_path", sa.literal(first) + sa.func.current_setting("search_path"), True))
        ).scalar_one()
        previous = str(path)[len(first):]
        try:
            yield
        finally:
            conn.execute(sa.select(sa.func.set_config("search_path", previous, True)))


def declare(config: ProcrastinateConfig) -> System:
    """Procrastinate's jobs, judged by its workers' heartbeats."""
    sql = ProcrastinateSql.of(config)
    return System(
        shape=Shape(
            key=sql.jobs.c.id, kind=sql.jobs.c.task_name, locks=sql.jobs,
            # Not the order of its (id, lock) index of waiting and running jobs: a quiet
            # scan reads the running rows by its running-jobs indexes instead of walking
            # them all.
            scan_order=sql.jobs.c.id + sa.literal_column("0"), scans_all_kinds=True),
        running=sql.running, expired=sql.expired, candidate=sql.candidate, swap=sql.swap,
        check_schema=sql.check_schema, listing=sql.listing, status_words=_STATUS_WORDS)


DECLARATION = Declaration(ProcrastinateConfig, declare)
