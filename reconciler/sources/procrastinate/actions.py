"""Operator retry and cancel on Procrastinate (3.x), through its own SQL functions.

- **retry** (a ``failed`` job): ``procrastinate_retry_job_v2(id, NULL, ...)``, as its
  ``JobManager.retry_job_by_id`` calls it (no ``retry_at``): ``todo``, runnable now, with a
  ``deferred_for_retry`` event; then ``attempts = 0``, a fresh budget for the task's retry
  strategy. A ``cancelled`` or ``aborted`` job is refused (``procrastinate_cannot_retry``):
  Procrastinate's function takes back only failed jobs.
- **cancel**: ``procrastinate_cancel_job_v1(id, abort => true, delete => false)``, as its
  ``cancel_job_by_id(abort=True)``: a ``todo`` job becomes ``cancelled`` (no worker will
  fetch it); a ``doing`` job gets ``abort_requested``, and its worker stops it only where
  the task checks for an abort (it then ends ``aborted``); a worker that died leaves it
  for a pass, which fails it as Procrastinate's retry function would.

Each is fenced on the job as read (status, attempts, worker) under its row lock: a job
that moved meanwhile is refused and the function is not called.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.kinds import KindRules
from reconciler.core.vocabulary import JobKey, JobStatus, OperatorAction
from reconciler.sources.kit.actions import ForeignJob, locked
from reconciler.sources.procrastinate.source import ProcrastinateConfig

WORDS = {"todo": JobStatus.QUEUED, "doing": JobStatus.PROCESSING,
         "succeeded": JobStatus.COMPLETED, "failed": JobStatus.FAILED,
         "cancelled": JobStatus.CANCELLED, "aborting": JobStatus.PROCESSING,
         "aborted": JobStatus.CANCELLED}
"""Procrastinate's statuses in this project's words (as its source reads them)."""

CANNOT_RETRY = "procrastinate_cannot_retry"
"""The refusal of a retry Procrastinate's own function does not take (a cancelled or
aborted job)."""


ABORT_REQUESTED = "abort_requested_already"
"""The refusal of a cancel of a job whose abort was requested already."""


class ProcrastinateActions:
    """Retry and cancel through Procrastinate's functions, on one transaction."""

    limits: Mapping[OperatorAction, str] = {
        OperatorAction.HOLD: "Procrastinate takes a job back by itself only where the app "
                             "retries stalled jobs (get_stalled_jobs, then retry_job): "
                             "once its worker's heartbeat is older than the app's timeout",
        OperatorAction.CANCEL: "a running job is asked to abort: its worker stops it only "
                               "where the task checks for an abort",
    }

    def __init__(self, connection: Connection, config: ProcrastinateConfig,
                 kinds: KindRules) -> None:
        self._conn = connection
        self._schema = config.schema
        self._jobs = sa.table("procrastinate_jobs", sa.column("id"), sa.column("status"),
                              sa.column("attempts"), sa.column("worker_id"),
                              sa.column("abort_requested"), schema=config.schema)

    def _function(self, name: str) -> str:
        if self._schema is None:
            return name
        return f"{self._conn.dialect.identifier_preparer.quote_identifier(self._schema)}.{name}"

    def read(self, job_key: JobKey, *, lock: bool) -> ForeignJob | None:
        """The job's status, attempts, worker and abort flag, its row locked with
        ``lock``."""
        jobs = self._jobs
        row = self._conn.execute(locked(
            sa.select(sa.cast(jobs.c.status, sa.Text()).label("status"), jobs.c.attempts,
                      jobs.c.worker_id, jobs.c.abort_requested)
            .where(jobs.c.id == job_key), lock)).first()
        if row is None:
            return None
        state = str(row.status)
        if state == "doing" and row.abort_requested:
            state = "doing (abort requested)"
        return ForeignJob(state, WORDS.get(str(row.status)), dict(row._mapping))

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """A cancelled or aborted job: Procrastinate's retry takes back failed jobs only;
        a job asked to abort is not asked again."""
        if action is OperatorAction.RETRY and job.fence["status"] in ("cancelled", "aborted"):
            return CANNOT_RETRY
        if action is OperatorAction.CANCEL and job.fence["abort_requested"]:
            return ABORT_REQUESTED
        return None

    def _still(self, job_key: JobKey, job: ForeignJob) -> bool:
        """The job is as read (status, attempts, worker)."""
        jobs, read = self._jobs, job.fence
        return self._conn.execute(sa.select(jobs.c.id).where(
            jobs.c.id == job_key, sa.cast(jobs.c.status, sa.Text()) == read["status"],
            jobs.c.attempts == read["attempts"],
            jobs.c.worker_id.is_not_distinct_from(read["worker_id"]))).first() is not None

    @contextmanager
    def _search_path(self) -> Iterator[None]:
        """Procrastinate's functions and triggers name its tables unqualified: its schema
        first in the search path for the call (this transaction only)."""
        if self._schema is None:
            yield
            return
        first = f"{self._conn.dialect.identifier_preparer.quote_identifier(self._schema)}, "
        path = self._conn.execute(sa.select(sa.func.set_config(
            "search_path", sa.literal(first) + sa.func.current_setting("search_path"), True))
        ).scalar_one()
        try:
            yield
        finally:
            self._conn.execute(sa.select(sa.func.set_config(
                "search_path", str(path)[len(first):], True)))

    def retry(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """Procrastinate's retry, runnable now, then a fresh attempt count."""
        if not self._still(job_key, job):
            return None
        with self._search_path():
            # No retry_at: runnable now, as the source's own resume writes it.
            self._conn.execute(sa.text(
                f"SELECT {self._function('procrastinate_retry_job_v2')}"
                "(:job_id, NULL, NULL, NULL, NULL)"), {"job_id": job_key})
            self._conn.execute(self._jobs.update().where(self._jobs.c.id == job_key)
                               .values(attempts=0))
        return self._status(job_key)

    def cancel(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """Procrastinate's cancel with abort: cancelled if queued, abort requested if
        running."""
        if not self._still(job_key, job):
            return None
        with self._search_path():
            done = self._conn.execute(sa.text(
                f"SELECT {self._function('procrastinate_cancel_job_v1')}"
                "(:job_id, true, false)"), {"job_id": job_key}).scalar_one()
        return None if done is None else self._status(job_key)

    def _status(self, job_key: JobKey) -> str:
        read: Any = self.read(job_key, lock=False)
        return str(read.state)


def open_actions(connection: Connection, config: ProcrastinateConfig,
                 kinds: KindRules) -> ProcrastinateActions:
    """Procrastinate's actions on ``connection`` (``kit.actions.ActionsOpener``)."""
    return ProcrastinateActions(connection, config, kinds)
