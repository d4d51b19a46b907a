"""Operator retry and cancel on graphile-worker (0.16, 0.17), through its own functions.

graphile-worker keeps no status: a job is locked (running), failed for good (``attempts``
reached ``max_attempts``) or waiting; it has no cancelled state.

- **retry** (a failed job): ``reschedule_jobs(ids, run_at => now(), attempts => 0)``, its
  own function: runnable now with a fresh attempt budget; its workers are nudged on
  ``jobs:insert``.
- **cancel** (a waiting job): ``permanently_fail_jobs(ids, 'operator_cancel')``, its own
  function: failed for good with ``last_error = operator_cancel``. A locked (running) job
  is refused (``graphile_worker_locked``): both functions skip locked jobs, and a running
  task's completion would delete the row whatever was written.

Fenced on the job as read (lock, attempts, budget) under its row lock: a job that moved
meanwhile is refused and the function is not called.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.kinds import KindRules
from reconciler.core.vocabulary import (
    JobKey,
    JobStatus,
    OperatorAction,
    OperatorStatusReason,
)
from reconciler.sources.graphile_worker.source import GraphileWorkerConfig
from reconciler.sources.kit.actions import ForeignJob, locked

LOCKED = "graphile_worker_locked"
"""The refusal of a cancel of a locked (running) job."""

WORDS = {"locked": JobStatus.PROCESSING, "queued": JobStatus.QUEUED,
         "failed": JobStatus.FAILED}
"""graphile-worker's shapes in this project's words (as its source lists them)."""


class GraphileWorkerActions:
    """Retry and cancel through graphile-worker's functions, on one transaction."""

    limits: Mapping[OperatorAction, str] = {
        OperatorAction.HOLD: "graphile-worker's own workers unlock the job 4 hours after "
                             "it was locked, and run it again",
        OperatorAction.CANCEL: "graphile-worker has no cancelled state: the job is failed "
                               "for good with reason operator_cancel",
    }

    def __init__(self, connection: Connection, config: GraphileWorkerConfig,
                 kinds: KindRules) -> None:
        self._conn = connection
        self._schema = config.schema
        self._jobs = sa.table("_private_jobs", sa.column("id"), sa.column("locked_at"),
                              sa.column("locked_by"), sa.column("attempts"),
                              sa.column("max_attempts"), schema=config.schema)

    def read(self, job_key: JobKey, *, lock: bool) -> ForeignJob | None:
        """The job's lock and attempts, its row locked with ``lock``."""
        jobs = self._jobs
        row = self._conn.execute(locked(
            sa.select(jobs.c.locked_at, jobs.c.locked_by, jobs.c.attempts, jobs.c.max_attempts)
            .where(jobs.c.id == job_key), lock)).first()
        if row is None:
            return None
        state = ("locked" if row.locked_at is not None
                 else "failed" if row.attempts >= row.max_attempts else "queued")
        return ForeignJob(state, WORDS[state], dict(row._mapping))

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """A locked job is not cancelled: graphile-worker's functions skip it."""
        if action is OperatorAction.CANCEL and job.state == "locked":
            return LOCKED
        return None

    def _still(self, job_key: JobKey, job: ForeignJob) -> bool:
        jobs, read = self._jobs, job.fence
        return self._conn.execute(sa.select(jobs.c.id).where(
            jobs.c.id == job_key, jobs.c.locked_at.is_not_distinct_from(read["locked_at"]),
            jobs.c.locked_by.is_not_distinct_from(read["locked_by"]),
            jobs.c.attempts == read["attempts"],
            jobs.c.max_attempts == read["max_attempts"])).first() is not None

    def _call(self, name: str, *arguments: Any) -> int:
        """How many jobs graphile-worker's function ``name`` changed."""
        function: sa.Function[Any] = sa.Function(name, *arguments,
                                                 packagenames=(self._schema,))
        return int(self._conn.execute(
            sa.select(sa.func.count()).select_from(function)).scalar_one())

    def retry(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """``reschedule_jobs``: runnable now, attempts from 0."""
        if not self._still(job_key, job):
            return None
        ids = sa.literal([int(job_key)], sa.ARRAY(sa.BigInteger()))
        if self._call("reschedule_jobs", ids, sa.func.now(), sa.null(),
                      sa.literal(0, sa.Integer()), sa.null()) != 1:
            return None
        # Its workers listen on jobs:insert; a nudge saves them a poll interval.
        self._conn.execute(sa.select(sa.func.pg_notify(
            "jobs:insert", json.dumps({"r": 0, "count": 1}))))
        return "queued"

    def cancel(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """``permanently_fail_jobs`` with reason ``operator_cancel``."""
        if not self._still(job_key, job):
            return None
        ids = sa.literal([int(job_key)], sa.ARRAY(sa.BigInteger()))
        reason = sa.literal(OperatorStatusReason.OPERATOR_CANCEL.value, sa.Text())
        if self._call("permanently_fail_jobs", ids, reason) != 1:
            return None
        return "failed"


def open_actions(connection: Connection, config: GraphileWorkerConfig,
                 kinds: KindRules) -> GraphileWorkerActions:
    """graphile-worker's actions on ``connection`` (``kit.actions.ActionsOpener``)."""
    return GraphileWorkerActions(connection, config, kinds)
