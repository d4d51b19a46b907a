"""Operator retry and cancel on Django's tasks framework (django-tasks-db), in its own
statuses: ``READY`` and ``FAILED``. Django's task API has no retry and no cancel of its own.

- **retry** (``FAILED``): ``READY``, as the backend's ``enqueue`` leaves a task (no start,
  no end, no result, no error; ``run_after`` as it was, which a claim proved due), with
  ``worker_ids`` emptied: the attempts Django counts, and the budget of the kind's
  ``max_attempts``, start again. Its ``db_worker`` takes it.
- **cancel** (``READY`` or ``RUNNING``): ``FAILED`` as the reconciler's own terminalization
  writes it, the traceback's last line ``RuntimeError: operator_cancel`` (Django has no
  cancelled status). A running task's worker is not stopped, and its end is written by id
  only: a task that finishes afterwards overwrites the cancel (docs/sources.md).

Fenced on the task as read (status, ``started_at``, ``worker_ids``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Connection

from reconciler.core.kinds import KindRules
from reconciler.core.vocabulary import JobKey, JobStatus, OperatorAction, OperatorStatusReason
from reconciler.sources.django_tasks.source import (
    EXCEPTION_CLASS_PATH,
    DjangoTasksConfig,
    failure_traceback,
    task_key,
)
from reconciler.sources.kit.actions import ForeignJob
from reconciler.sources.kit.shapes import constant
from reconciler.storage.clock import db_now
from reconciler.storage.sql import for_update

WORDS = {"READY": JobStatus.QUEUED, "RUNNING": JobStatus.PROCESSING,
         "SUCCESSFUL": JobStatus.COMPLETED, "FAILED": JobStatus.FAILED}
"""Django's task result statuses in this project's words."""


class DjangoTasksActions:
    """Retry and cancel on the backend's result table, on one transaction."""

    limits: Mapping[OperatorAction, str] = {
        OperatorAction.HOLD: "django-tasks-db never takes a running task back by itself",
        OperatorAction.CANCEL: "Django has no cancelled status: FAILED with "
                               "operator_cancel; a running task's worker is not stopped, "
                               "and its end, if it comes, overwrites this",
    }

    def __init__(self, connection: Connection, config: DjangoTasksConfig,
                 kinds: KindRules) -> None:
        self._conn = connection
        self._config = config
        self._tasks = sa.table(config.table, *(sa.column(c) for c in (
            "id", "status", "backend_name", "started_at", "finished_at", "worker_ids",
            "return_value", "exception_class_path", "traceback")))

    def _by_keys(self, job_keys: Sequence[JobKey]) -> list[sa.ColumnElement[bool]]:
        tasks = self._tasks
        where: list[sa.ColumnElement[bool]] = [
            task_key(tasks.c.id).in_([str(key) for key in job_keys])]
        if self._config.backend_name is not None:
            where.append(tasks.c.backend_name == self._config.backend_name)
        return where

    def read(self, job_key: JobKey, *, lock: bool) -> ForeignJob | None:
        """The task's status and claim as read, its row locked where the engine can."""
        return self.read_many([job_key], lock=lock).get(job_key)

    def read_many(self, job_keys: Sequence[JobKey], *, lock: bool
                  ) -> dict[JobKey, ForeignJob]:
        """The tasks of these ids the backend has, in one statement, their rows locked
        with ``lock`` where the engine can."""
        if not job_keys:
            return {}
        tasks, keys = self._tasks, {str(key): key for key in job_keys}
        query = sa.select(task_key(tasks.c.id).label("key"), tasks.c.status,
                          tasks.c.started_at,
                          sa.cast(tasks.c.worker_ids, sa.Text()).label("worker_ids")
                          ).where(*self._by_keys(list(job_keys)))
        found = {}
        for row in self._conn.execute(for_update(self._conn.dialect.name, query, lock=lock,
                                                 skip_locked=False)):
            fence = {k: v for k, v in row._mapping.items() if k != "key"}
            status = str(row.status)
            found[keys[str(row.key)]] = ForeignJob(status, WORDS.get(status), fence)
        return found

    def swap_many(self, action: OperatorAction, jobs: Mapping[JobKey, ForeignJob],
                  refused: dict[JobKey, str]) -> dict[JobKey, str]:
        """A chunk's retry or cancel in one UPDATE, each row repeating its own fence; read
        locked in this transaction, every row is still as read, so a count that differs
        is a row that moved, and the chunk is then swapped row by row (inside a
        savepoint). Django has no rule of its own to refuse by."""
        status, values = self._retried() if action is OperatorAction.RETRY else self._cancelled()
        fenced = sa.or_(*(sa.and_(*self._fenced(key, job)) for key, job in jobs.items()))
        with self._conn.begin_nested() as savepoint:
            done = self._conn.execute(self._tasks.update().where(fenced)
                                      .values(status=constant(status), **values))
            if done.rowcount == len(jobs):
                return dict.fromkeys(jobs, status)
            savepoint.rollback()
        return {key: status for key, job in jobs.items()
                if self._swap(key, job, status, dict(values)) is not None}

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """Nothing of Django's own beyond its statuses."""
        return None

    def _fenced(self, job_key: JobKey, job: ForeignJob) -> list[sa.ColumnElement[bool]]:
        """The task as read: its id, status and claim."""
        tasks, read = self._tasks, job.fence
        return [*self._by_keys([job_key]), tasks.c.status == constant(read["status"]),
                tasks.c.started_at.is_not_distinct_from(read["started_at"]),
                sa.cast(tasks.c.worker_ids, sa.Text()).is_not_distinct_from(
                    read["worker_ids"])]

    def _swap(self, job_key: JobKey, job: ForeignJob, status: str,
              values: dict[str, Any]) -> str | None:
        done = self._conn.execute(self._tasks.update().where(*self._fenced(job_key, job))
                                  .values(status=constant(status), **values))
        return status if done.rowcount == 1 else None

    def _retried(self) -> tuple[str, dict[str, Any]]:
        """``READY`` as enqueued, its attempts from none (``run_after`` left as it is: a
        claim of the task proved it due)."""
        empty: Any = (sa.cast(sa.literal("[]"), JSONB)
                      if self._conn.dialect.name == "postgresql" else "[]")
        return "READY", {"started_at": None, "finished_at": None, "return_value": None,
                         "exception_class_path": "", "traceback": "", "worker_ids": empty}

    def _cancelled(self) -> tuple[str, dict[str, Any]]:
        """``FAILED`` with ``operator_cancel``, as a terminalization writes it."""
        return "FAILED", {
            "finished_at": db_now(), "return_value": None,
            "exception_class_path": EXCEPTION_CLASS_PATH,
            "traceback": failure_traceback(OperatorStatusReason.OPERATOR_CANCEL.value)}

    def retry(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """``READY`` as enqueued, runnable now, its attempts from none."""
        status, values = self._retried()
        return self._swap(job_key, job, status, values)

    def cancel(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """``FAILED`` with ``operator_cancel``, as a terminalization writes it."""
        status, values = self._cancelled()
        return self._swap(job_key, job, status, values)


def open_actions(connection: Connection, config: DjangoTasksConfig,
                 kinds: KindRules) -> DjangoTasksActions:
    """Django tasks' actions on ``connection`` (``kit.actions.ActionsOpener``)."""
    return DjangoTasksActions(connection, config, kinds)
