"""Operator retry and cancel on Celery (5.x): its result row, then its broker, as the
celery source's own resume and terminalization do.

- **retry** (a ``FAILURE`` row, ours included): the row in Celery's ``RETRY`` shape, then the
  task re-published through ``send_task`` with the same id, name, args, kwargs and queue and
  ``retries = 0`` (a fresh budget), so the caller's ``AsyncResult`` completes when a worker
  runs it. Refused for a ``REVOKED`` task (``celery_revoked``: its workers keep revoked
  ids and would discard the message) and for a row whose args the table does not hold
  faithfully (``celery_arguments_unknown``).
- **cancel** (a ``STARTED`` or ``RETRY`` row): ``REVOKED`` with ``TaskRevokedError`` as its
  result, so ``AsyncResult.get()`` raises; a ``RETRY`` task's message is taken off its
  queue, and Celery's own ``revoke`` is sent to the live workers. A running task is not stopped (no
  ``terminate``: that would kill whatever else its pool process runs); a worker that
  starts after the revoke does not know it.

A chunk (``BatchActions``; one job is a chunk of one) is read in one ``SELECT`` and
swapped in one ``UPDATE``, each row fenced inside it on its status, worker, retries and
(django-celery-results) its ``date_done`` as read; the broker is told only of the rows
that swapped, once for the chunk: the retried tasks re-published in one pipeline, the
cancelled ones taken off their queues in two round trips and revoked in one broadcast.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.kinds import KindRules
from reconciler.core.vocabulary import JobKey, JobStatus, OperatorAction, OperatorStatusReason
from reconciler.sources.celery.broker import CeleryBroker, Publication
from reconciler.sources.celery.source import CeleryConfig
from reconciler.sources.celery.tables import (
    ResultRows,
    call_arguments,
    queue_for,
    shape_for,
)
from reconciler.sources.kit.actions import ForeignJob, SystemRefusal, locked
from reconciler.sources.kit.shapes import UtcTimes, constant
from reconciler.storage.clock import db_now
from reconciler.storage.sql import SQLITE

WORDS = {"PENDING": JobStatus.QUEUED, "RECEIVED": JobStatus.QUEUED,
         "RETRY": JobStatus.QUEUED, "STARTED": JobStatus.PROCESSING,
         "SUCCESS": JobStatus.COMPLETED, "FAILURE": JobStatus.FAILED,
         "REVOKED": JobStatus.CANCELLED}
"""Celery's task states in this project's words."""

REVOKED = "celery_revoked"
ARGUMENTS_UNKNOWN = "celery_arguments_unknown"
REVOKED_RESULT = json.dumps({"exc_type": "TaskRevokedError", "exc_message": ["revoked"],
                             "exc_module": "celery.exceptions"})
"""A ``REVOKED`` row's result, as Celery's JSON serializer writes its revoke."""


class CeleryActions:
    """Retry and cancel on Celery's result table and broker, on one transaction."""

    limits: Mapping[OperatorAction, str] = {
        OperatorAction.HOLD: "Celery takes a task back by itself only under task_acks_late: "
                             "the broker puts its message back on its queue "
                             "visibility_timeout after delivery (an hour by default), and "
                             "a worker runs it again",
        OperatorAction.CANCEL: "revoked on the live workers; a running task is not "
                               "stopped (no terminate)",
    }

    def __init__(self, connection: Connection, config: CeleryConfig, kinds: KindRules, *,
                 broker: CeleryBroker | None = None) -> None:
        self._conn = connection
        self._config = config
        self._shape = shape_for(config.result_table)
        self._result = ResultRows(config.result_table, self._shape)
        self._rows = self._result.sql_table
        self._broker = broker or CeleryBroker(config.url)
        # Celery writes naive UTC: write date_done so.
        self._utc = UtcTimes(connection)

    def read(self, job_key: JobKey, *, lock: bool) -> ForeignJob | None:
        """The row's status, claim and call, locked where the engine can: a chunk of one
        (``read_many``), so that one job and a chunk are fenced alike."""
        return self.read_many([job_key], lock=lock).get(job_key)

    def read_many(self, job_keys: Sequence[JobKey], *, lock: bool
                  ) -> dict[JobKey, ForeignJob]:
        """The rows of these task ids the table has, in one statement, locked with
        ``lock`` on PostgreSQL and MySQL (SQLite's write lock is the transaction's). The
        broker holds nothing a swap repeats: a chunk's read is this one statement."""
        if not job_keys:
            return {}
        rows, result, keys = self._rows, self._result, {str(key): key for key in job_keys}
        columns = [rows.c.task_id, rows.c.status, rows.c.worker, rows.c.date_done,
                   result.name.label("name"), result.args.label("args"),
                   result.kwargs.label("kwargs")]
        if result.retries is not None:
            columns.append(result.retries.label("retries"))
        if result.queue is not None:
            columns.append(result.queue.label("queue"))
        query = sa.select(*columns).where(rows.c.task_id.in_(list(keys)))
        found = {}
        for row in self._conn.execute(locked(query, lock and self._conn.dialect.name != SQLITE)):
            fence = {k: v for k, v in row._mapping.items() if k != "task_id"}
            state = str(row.status)
            found[keys[str(row.task_id)]] = ForeignJob(state, WORDS.get(state), fence)
        return found

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """A revoked task is not re-run under its id; nor one whose call is not known."""
        if action is not OperatorAction.RETRY:
            return None
        if job.state == "REVOKED":
            return REVOKED
        return ARGUMENTS_UNKNOWN if self._call(job.fence) is None else None

    def retry(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """The row in Celery's RETRY shape, then the task re-published with its own id: a
        chunk of one (``swap_many``)."""
        return self._one(OperatorAction.RETRY, job_key, job)

    def cancel(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """REVOKED in the row, then Celery's revoke to the live workers: a chunk of one."""
        return self._one(OperatorAction.CANCEL, job_key, job)

    def _one(self, action: OperatorAction, job_key: JobKey, job: ForeignJob) -> str | None:
        refused: dict[JobKey, str] = {}
        after = self.swap_many(action, {job_key: job}, refused)
        if job_key in refused:
            raise SystemRefusal(refused[job_key])
        return after.get(job_key)

    def swap_many(self, action: OperatorAction, jobs: Mapping[JobKey, ForeignJob],
                  refused: dict[JobKey, str]) -> dict[JobKey, str]:
        """A chunk's retry or cancel: one ``UPDATE`` over its rows, each repeating its own
        fence, then the broker told of the rows it changed, once for the chunk (retried:
        re-published in one pipeline; cancelled: a ``RETRY`` task's message taken off its
        queue, then one revoke of them all). A retried task whose call cannot be rebuilt
        is refused ``celery_arguments_unknown`` and its row left as it is."""
        if action is OperatorAction.RETRY:
            sent = {key: p for key, job in jobs.items()
                    if (p := self._publication(str(key), job)) is not None}
            refused.update(dict.fromkeys(set(jobs) - set(sent), ARGUMENTS_UNKNOWN))
            swapped = self._swapped({key: jobs[key] for key in sent}, self._retried())
            self._broker.publish_many([sent[key] for key in swapped])
            return dict.fromkeys(swapped, "RETRY")
        swapped = self._swapped(jobs, self._revoked())
        queued: dict[str, set[str]] = {}
        for key in swapped:
            read = jobs[key].fence
            if jobs[key].state == "RETRY" and read["name"] is not None:
                # A re-published task waits on its queue: a worker started after the
                # revoke would not know it, so its message is taken off the queue too.
                queued.setdefault(self._queue_of(read), set()).add(str(key))
        self._broker.take_queued(queued)
        self._broker.revoke(*(str(key) for key in swapped))
        return dict.fromkeys(swapped, "REVOKED")

    def _retried(self) -> dict[Any, Any]:
        """A retried row's values: Celery's RETRY shape, a fresh count."""
        values = self._result.written(OperatorStatusReason.OPERATOR_RETRY.value, resume=True)
        if self._result.retries is not None:
            values[self._result.retries] = 0
        return values

    def _revoked(self) -> dict[Any, Any]:
        """A cancelled row's values: REVOKED, as Celery's revoke writes it."""
        c = self._rows.c
        values: dict[Any, Any] = {c.status: constant("REVOKED"), c.date_done: db_now(),
                                  c.traceback: sa.null()}
        if self._shape.text_result:
            values |= {c.result: REVOKED_RESULT, c.content_type: "application/json",
                       c.content_encoding: "utf-8"}
        else:
            values[c.result] = REVOKED_RESULT.encode()
        return values

    def _fenced(self, job_key: JobKey, job: ForeignJob) -> list[sa.ColumnElement[bool]]:
        """The row as read: its id, status, worker, retries and (where every write
        stamps it) ``date_done``."""
        rows, result, read = self._rows, self._result, job.fence
        where = [rows.c.task_id == str(job_key), rows.c.status == constant(job.state),
                 rows.c.worker.is_not_distinct_from(read["worker"])]
        if result.retries is not None:
            where.append(result.retries.is_not_distinct_from(read["retries"]))
        if self._shape.stamps_every_write:
            where.append(rows.c.date_done.is_not_distinct_from(read["date_done"]))
        return where

    def _swapped(self, jobs: Mapping[JobKey, ForeignJob], values: dict[Any, Any]
                 ) -> list[JobKey]:
        """The jobs whose rows one fenced ``UPDATE`` of ``values`` changed (a row that
        moved since its read keeps its fence from matching, and is left as it is)."""
        if not jobs:
            return []
        self._utc()
        rows = self._rows
        # The chunk's ids first, so the key's index finds the rows; then each row's fence.
        update = rows.update().where(
            rows.c.task_id.in_([str(key) for key in jobs]),
            sa.or_(*(sa.and_(*self._fenced(key, job)) for key, job in jobs.items()))
        ).values(values)
        if self._conn.dialect.update_returning:
            changed = set(self._conn.execute(update.returning(rows.c.task_id)).scalars())
            return [key for key in jobs if str(key) in changed]
        # MySQL has no UPDATE ... RETURNING. Read locked in this transaction, every row is
        # still as read: a count that differs is a row that moved, and the chunk is then
        # swapped row by row (the one statement undone by its savepoint).
        with self._conn.begin_nested() as savepoint:
            if self._conn.execute(update).rowcount == len(jobs):
                return list(jobs)
            savepoint.rollback()
        return [key for key, job in jobs.items() if self._conn.execute(
            rows.update().where(*self._fenced(key, job)).values(values)).rowcount == 1]

    def _queue_of(self, read: Mapping[str, Any]) -> str:
        """The queue the row keeps, else the one the app's ``task_routes`` give its name."""
        return str(read.get("queue") or queue_for(read["name"], self._config.task_routes,
                                                  self._config.task_default_queue))

    def _call(self, read: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]] | None:
        """The task's args and kwargs as sent; None when the row does not hold its name
        and call faithfully (it cannot be re-published)."""
        if read["name"] is None:
            return None
        return call_arguments(read["args"], read["kwargs"], self._shape)

    def _publication(self, task_id: str, job: ForeignJob) -> Publication | None:
        """The task as ``send_task`` re-publishes it, with a fresh count; None when its
        call is not known."""
        arguments = self._call(job.fence)
        if arguments is None:
            return None
        return Publication(task_id, job.fence["name"], args=arguments[0],
                           kwargs=arguments[1], queue=self._queue_of(job.fence), retries=0)


def open_actions(connection: Connection, config: CeleryConfig,
                 kinds: KindRules) -> CeleryActions:
    """Celery's actions on ``connection`` (``kit.actions.ActionsOpener``)."""
    return CeleryActions(connection, config, kinds)
