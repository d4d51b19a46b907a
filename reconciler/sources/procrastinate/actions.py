"""Operator retry and cancel on Procrastinate (3.x), through its own SQL functions.

- **retry** (a ``failed`` job): ``procrastinate_retry_job_v2(id, NULL, ...)``, as its
  ``JobManager.retry_job_by_id`` calls it (no ``retry_at``): ``todo``, runnable now, with a
  ``deferred_for_retry`` event; then ``attempts = 0``, a fresh budget for the task's retry
  strategy. A ``cancelled`` or ``aborted`` job is refused (``procrastinate_cannot_retry``):
  Procrastinate's function takes back only failed jobs; so is a job whose queueing lock a
  ``todo`` job holds (``procrastinate_already_enqueued``: its unique index refuses it).
- **cancel**: ``procrastinate_cancel_job_v1(id, abort => true, delete => false)``, as its
  ``cancel_job_by_id(abort=True)``: a ``todo`` job becomes ``cancelled`` (no worker will
  fetch it); a ``doing`` job gets ``abort_requested``, and its worker stops it only where
  the task checks for an abort (it then ends ``aborted``); a worker that died leaves it
  for a pass, which fails it as Procrastinate's retry function would.

Each is fenced on the job as read (status, attempts, worker) under its row lock: a job
that moved meanwhile is refused and the function is not called.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from reconciler.core.kinds import KindRules
from reconciler.core.vocabulary import JobKey, JobStatus, OperatorAction
from reconciler.sources.kit.actions import ForeignJob, SystemRefusal, locked
from reconciler.sources.procrastinate.source import ProcrastinateConfig

WORDS = {"todo": JobStatus.QUEUED, "doing": JobStatus.PROCESSING,
         "succeeded": JobStatus.COMPLETED, "failed": JobStatus.FAILED,
         "cancelled": JobStatus.CANCELLED, "aborting": JobStatus.PROCESSING,
         "aborted": JobStatus.CANCELLED}
"""Procrastinate's statuses in this project's words (as its source reads them)."""

CANNOT_RETRY = "procrastinate_cannot_retry"
"""The refusal of a retry Procrastinate's own function does not take (a cancelled or
aborted job)."""


ALREADY_ENQUEUED = "procrastinate_already_enqueued"
"""The refusal of a retry that would give the queue a second ``todo`` job of the same
queueing lock (Procrastinate's unique index; its own defer says ``AlreadyEnqueued``)."""

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
        return self.read_many([job_key], lock=lock).get(job_key)

    def read_many(self, job_keys: Sequence[JobKey], *, lock: bool
                  ) -> dict[JobKey, ForeignJob]:
        """The jobs of these ids Procrastinate has, in one statement, their rows locked
        with ``lock``."""
        ids = {int(key): key for key in job_keys}
        if not ids:
            return {}
        jobs = self._jobs
        found = {}
        for row in self._conn.execute(locked(
                sa.select(jobs.c.id, sa.cast(jobs.c.status, sa.Text()).label("status"),
                          jobs.c.attempts, jobs.c.worker_id, jobs.c.abort_requested)
                .where(jobs.c.id.in_(sorted(ids))), lock)):
            state = str(row.status)
            if state == "doing" and row.abort_requested:
                state = "doing (abort requested)"
            fence = {k: v for k, v in row._mapping.items() if k != "id"}
            found[ids[int(row.id)]] = ForeignJob(state, WORDS.get(str(row.status)), fence)
        return found

    def swap_many(self, action: OperatorAction, jobs: Mapping[JobKey, ForeignJob],
                  refused: dict[JobKey, str]) -> dict[JobKey, str]:
        """A chunk's retry or cancel: the jobs still as read found in one statement,
        Procrastinate's function called for each of them in one more (over ``unnest``),
        a retry's fresh attempt count in a third, their statuses read back in a fourth;
        the jobs it changed, with their status after. A retry its queueing-lock index
        refuses (a ``todo`` job of the same lock) rolls its savepoint back, and the jobs
        are then called one by one, each in its own, so that the refusal
        (``procrastinate_already_enqueued``) is that job's own."""
        still = self._still_many(jobs)  # one statement for the chunk, never one per job
        ids = {int(key): key for key in jobs if int(key) in still}
        if not ids:
            return {}
        with self._search_path():
            try:
                changed = self._called(action, sorted(ids))
            except IntegrityError:
                changed = set()
                for job_id in sorted(ids):
                    try:
                        changed |= self._called(action, [job_id])
                    except IntegrityError:
                        refused[ids[job_id]] = ALREADY_ENQUEUED
        keys = [ids[job_id] for job_id in sorted(changed)]
        return {key: job.state for key, job in self.read_many(keys, lock=False).items()}

    def _called(self, action: OperatorAction, ids: list[int]) -> set[int]:
        """Procrastinate's retry (then a fresh attempt count) or cancel of each job, in a
        savepoint (an ``IntegrityError`` leaves the transaction as it was); the ids it
        changed."""
        over = "FROM unnest(CAST(:ids AS bigint[])) AS id"
        with self._conn.begin_nested():
            if action is OperatorAction.RETRY:
                # No retry_at: runnable now, as the source's own resume writes it.
                self._conn.execute(sa.text(
                    f"SELECT {self._function('procrastinate_retry_job_v2')}"
                    f"(id, NULL, NULL, NULL, NULL) {over}"), {"ids": ids})
                self._conn.execute(self._jobs.update().where(self._jobs.c.id.in_(ids))
                                   .values(attempts=0))
                return set(ids)
            return {int(i) for i, done in self._conn.execute(sa.text(
                f"SELECT id, {self._function('procrastinate_cancel_job_v1')}"
                f"(id, true, false) {over}"), {"ids": ids}) if done is not None}

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """A cancelled or aborted job: Procrastinate's retry takes back failed jobs only;
        a job asked to abort is not asked again."""
        if action is OperatorAction.RETRY and job.fence["status"] in ("cancelled", "aborted"):
            return CANNOT_RETRY
        if action is OperatorAction.CANCEL and job.fence["abort_requested"]:
            return ABORT_REQUESTED
        return None

    def _still_many(self, jobs: Mapping[JobKey, ForeignJob]) -> set[int]:
        """The ids of the jobs still as read (status, attempts, worker), in one read."""
        table = self._jobs
        return {int(i) for i in self._conn.execute(sa.select(table.c.id).where(sa.or_(*(
            sa.and_(table.c.id == key,
                    sa.cast(table.c.status, sa.Text()) == job.fence["status"],
                    table.c.attempts == job.fence["attempts"],
                    table.c.worker_id.is_not_distinct_from(job.fence["worker_id"]))
            for key, job in jobs.items())))).scalars()}

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
        """Procrastinate's retry, runnable now, then a fresh attempt count;
        ``SystemRefusal`` where its queueing lock is taken by a ``todo`` job."""
        refused: dict[JobKey, str] = {}
        after = self.swap_many(OperatorAction.RETRY, {job_key: job}, refused)
        if job_key in refused:
            raise SystemRefusal(refused[job_key])
        return after.get(job_key)

    def cancel(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """Procrastinate's cancel with abort: cancelled if queued, abort requested if
        running."""
        return self.swap_many(OperatorAction.CANCEL, {job_key: job}, {}).get(job_key)


def open_actions(connection: Connection, config: ProcrastinateConfig,
                 kinds: KindRules) -> ProcrastinateActions:
    """Procrastinate's actions on ``connection`` (``kit.actions.ActionsOpener``)."""
    return ProcrastinateActions(connection, config, kinds)
