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
from collections.abc import Mapping, Sequence
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
        return self.read_many([job_key], lock=lock).get(job_key)

    def read_many(self, job_keys: Sequence[JobKey], *, lock: bool
                  ) -> dict[JobKey, ForeignJob]:
        """The jobs of these ids graphile-worker still holds, in one statement, their
        rows locked with ``lock``."""
        ids = {int(key): key for key in job_keys}
        if not ids:
            return {}
        jobs = self._jobs
        found = {}
        for row in self._conn.execute(locked(
                sa.select(jobs.c.id, jobs.c.locked_at, jobs.c.locked_by, jobs.c.attempts,
                          jobs.c.max_attempts).where(jobs.c.id.in_(sorted(ids))), lock)):
            state = ("locked" if row.locked_at is not None
                     else "failed" if row.attempts >= row.max_attempts else "queued")
            fence = {k: v for k, v in row._mapping.items() if k != "id"}
            found[ids[int(row.id)]] = ForeignJob(state, WORDS[state], fence)
        return found

    def swap_many(self, action: OperatorAction, jobs: Mapping[JobKey, ForeignJob],
                  refused: dict[JobKey, str]) -> dict[JobKey, str]:
        """A chunk's retry (``reschedule_jobs``) or cancel (``permanently_fail_jobs``):
        the jobs still as read found in one statement, the function called once with all
        their ids, one nudge; the jobs it changed. (Its own rules refuse nothing here: a
        locked job's cancel was refused before.)"""
        ids = self._still_many(jobs)
        if not ids:
            return {}
        array = sa.literal(sorted(ids), sa.ARRAY(sa.BigInteger()))
        if action is OperatorAction.RETRY:
            changed = self._changed("reschedule_jobs", array, sa.func.now(), sa.null(),
                                    sa.literal(0, sa.Integer()), sa.null())
            if changed:
                self._nudge(len(changed))
            state = "queued"
        else:
            changed = self._changed("permanently_fail_jobs", array, sa.literal(
                OperatorStatusReason.OPERATOR_CANCEL.value, sa.Text()))
            state = "failed"
        return {key: state for key in jobs if int(key) in changed}

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """A locked job is not cancelled: graphile-worker's functions skip it."""
        if action is OperatorAction.CANCEL and job.state == "locked":
            return LOCKED
        return None

    def _still_many(self, jobs: Mapping[JobKey, ForeignJob]) -> set[int]:
        """The ids of the jobs still as read (lock, attempts, budget), in one read."""
        table = self._jobs
        return {int(i) for i in self._conn.execute(sa.select(table.c.id).where(sa.or_(*(
            sa.and_(table.c.id == key,
                    table.c.locked_at.is_not_distinct_from(job.fence["locked_at"]),
                    table.c.locked_by.is_not_distinct_from(job.fence["locked_by"]),
                    table.c.attempts == job.fence["attempts"],
                    table.c.max_attempts == job.fence["max_attempts"])
            for key, job in jobs.items())))).scalars()}

    def _changed(self, name: str, *arguments: Any) -> set[int]:
        """The ids of the jobs graphile-worker's function ``name`` changed."""
        function = sa.Function(name, *arguments, packagenames=(self._schema,)) \
            .table_valued("id")
        return {int(i) for i in self._conn.execute(sa.select(function.c.id)).scalars()}

    def _nudge(self, count: int) -> None:
        """Its workers listen on ``jobs:insert``: a nudge saves them a poll interval."""
        self._conn.execute(sa.select(sa.func.pg_notify(
            "jobs:insert", json.dumps({"r": 0, "count": count}))))

    def retry(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """``reschedule_jobs``: runnable now, attempts from 0."""
        return self.swap_many(OperatorAction.RETRY, {job_key: job}, {}).get(job_key)

    def cancel(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """``permanently_fail_jobs`` with reason ``operator_cancel``."""
        return self.swap_many(OperatorAction.CANCEL, {job_key: job}, {}).get(job_key)


def open_actions(connection: Connection, config: GraphileWorkerConfig,
                 kinds: KindRules) -> GraphileWorkerActions:
    """graphile-worker's actions on ``connection`` (``kit.actions.ActionsOpener``)."""
    return GraphileWorkerActions(connection, config, kinds)
