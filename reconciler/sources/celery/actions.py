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

The row is swapped fenced on its status, worker, retries and (django-celery-results) its
``date_done`` as read; the broker is told only once the row swapped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.kinds import KindRules
from reconciler.core.vocabulary import JobKey, JobStatus, OperatorAction, OperatorStatusReason
from reconciler.sources.celery.broker import CeleryBroker
from reconciler.sources.celery.source import CeleryConfig
from reconciler.sources.celery.tables import (
    ResultRows,
    call_arguments,
    queue_for,
    shape_for,
)
from reconciler.sources.kit.actions import ForeignJob, read_locked
from reconciler.sources.kit.shapes import UtcTimes, constant
from reconciler.storage.clock import db_now

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
        """The row's status, claim and call, locked where the engine can."""
        rows, result = self._rows, self._result
        columns = [rows.c.status, rows.c.worker, rows.c.date_done, result.name.label("name"),
                   result.args.label("args"), result.kwargs.label("kwargs")]
        if result.retries is not None:
            columns.append(result.retries.label("retries"))
        if result.queue is not None:
            columns.append(result.queue.label("queue"))
        return read_locked(self._conn, sa.select(*columns).where(rows.c.task_id == str(job_key)),
                           "status", WORDS, lock=lock)

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """A revoked task is not re-run under its id; nor one whose call is not known."""
        if action is not OperatorAction.RETRY:
            return None
        if job.state == "REVOKED":
            return REVOKED
        read = job.fence
        if read["name"] is None or call_arguments(read["args"], read["kwargs"],
                                                  self._shape) is None:
            return ARGUMENTS_UNKNOWN
        return None

    def _swap(self, job_key: JobKey, job: ForeignJob, values: dict[Any, Any]) -> bool:
        self._utc()
        rows, result, read = self._rows, self._result, job.fence
        where = [rows.c.task_id == str(job_key), rows.c.status == constant(job.state),
                 rows.c.worker.is_not_distinct_from(read["worker"])]
        if result.retries is not None:
            where.append(result.retries.is_not_distinct_from(read["retries"]))
        if self._shape.stamps_every_write:
            where.append(rows.c.date_done.is_not_distinct_from(read["date_done"]))
        return self._conn.execute(rows.update().where(*where).values(values)).rowcount == 1

    def retry(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """The row in Celery's RETRY shape, then the task re-published with its own id."""
        values = self._result.written(OperatorStatusReason.OPERATOR_RETRY.value, resume=True)
        if self._result.retries is not None:
            values[self._result.retries] = 0
        if not self._swap(job_key, job, values):
            return None
        read = job.fence
        arguments = call_arguments(read["args"], read["kwargs"], self._shape)
        if arguments is None:  # pragma: no cover - refused before (``refuses``)
            return None
        queue = read.get("queue") or queue_for(read["name"], self._config.task_routes,
                                               self._config.task_default_queue)
        self._broker.publish(str(job_key), read["name"], args=arguments[0],
                             kwargs=arguments[1], queue=queue, retries=0)
        return "RETRY"

    def cancel(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """REVOKED in the row, then Celery's revoke to the live workers."""
        c = self._rows.c
        values: dict[Any, Any] = {c.status: constant("REVOKED"), c.date_done: db_now(),
                                  c.traceback: sa.null()}
        if self._shape.text_result:
            values |= {c.result: REVOKED_RESULT, c.content_type: "application/json",
                       c.content_encoding: "utf-8"}
        else:
            values[c.result] = REVOKED_RESULT.encode()
        if not self._swap(job_key, job, values):
            return None
        read = job.fence
        if job.state == "RETRY" and read["name"] is not None:
            # A re-published task waits on its queue: a worker started after the revoke
            # would not know it, so its message is taken off the queue too.
            self._take_queued(str(job_key), read.get("queue") or queue_for(
                read["name"], self._config.task_routes, self._config.task_default_queue))
        self._broker.revoke(str(job_key))
        return "REVOKED"

    def _take_queued(self, task_id: str, queue: str) -> int:
        """Remove the task's messages from its Redis queue (kombu keeps a queue as a list
        of JSON messages); how many were removed."""
        removed = 0
        with self._broker.app().connection_for_write() as connection:
            client = connection.default_channel.client
            for raw in client.lrange(queue, 0, -1):
                try:
                    task = json.loads(raw)["headers"]["id"]
                except (ValueError, KeyError, TypeError):
                    continue
                if task == task_id:
                    removed += int(client.lrem(queue, 1, raw))
        return removed


def open_actions(connection: Connection, config: CeleryConfig,
                 kinds: KindRules) -> CeleryActions:
    """Celery's actions on ``connection`` (``kit.actions.ActionsOpener``)."""
    return CeleryActions(connection, config, kinds)
