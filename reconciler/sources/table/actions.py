"""Operator retry and cancel on a mapped table, in its mapped statuses.

- **retry** (a job in the ``failed`` status, or the ``cancelled`` one where mapped):
  ``status = queued``, ``resume_column`` = the first step its ``steps_column`` does not
  record as succeeded, ``attempts_column = 0`` (a fresh attempt budget),
  ``generation_column + 1``, ``reason_column`` cleared.
- **cancel** (a ``queued`` or ``processing`` job): the ``cancelled`` status where
  ``[source]`` maps one, else ``failed`` with ``reason_column = operator_cancel``;
  ``generation_column + 1``. A running job's worker is not stopped: the table has no way
  to reach it, and only its own next write against the generation (or status) can tell it.
- A status the mapping does not name is refused (``status_not_mapped``).

Each swap repeats the status and every fenced column as read (owner, attempts, generation,
lease, activity) in its WHERE clause: a job that moved meanwhile is refused, unchanged. A
chunk's swap is one UPDATE joined to its rows as read, sent as one JSON parameter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.kinds import KindRules
from reconciler.core.policy import first_unfinished_step
from reconciler.core.vocabulary import (
    JobKey,
    JobStatus,
    OperatorAction,
    OperatorStatusReason,
    StepState,
)
from reconciler.sources.kit.actions import ForeignJob
from reconciler.sources.kit.rows import rows_as_read
from reconciler.sources.kit.shapes import constant
from reconciler.sources.table.config import TableConfig
from reconciler.storage.sql import for_update, unindexed

FENCED_KEYS = ("owner_column", "attempts_column", "generation_column",
               "lease_expires_column", "activity_column")
"""The mapped columns a swap repeats as read, besides the status."""


class TableActions:
    """Retry and cancel on one mapped table, on one transaction's connection."""

    limits: Mapping[OperatorAction, str] = {
        OperatorAction.HOLD: "a sweep of the job system's own over its table is not held",
        OperatorAction.CANCEL: "a running job's worker is not stopped: the table cannot "
                               "reach it",
    }

    def __init__(self, connection: Connection, config: TableConfig,
                 kinds: KindRules) -> None:
        self._conn = connection
        self._config = config
        self._columns = config.mapped_columns()
        self._table = sa.table(config.table, *(sa.column(c) for c in self._columns.values()),
                               schema=config.schema)
        words = {config.processing: JobStatus.PROCESSING, config.queued: JobStatus.QUEUED,
                 config.failed: JobStatus.FAILED}
        if config.cancelled is not None:
            words[config.cancelled] = JobStatus.CANCELLED
        self._words = words

    def _col(self, key: str) -> sa.ColumnElement[Any]:
        return self._table.c[self._columns[key]]

    def _has(self, key: str) -> bool:
        return key in self._columns

    def read(self, job_key: JobKey, *, lock: bool) -> ForeignJob | None:
        """The row's status and fenced columns, locked where the engine has row locks."""
        return self._read(self._col("id_column") == job_key, lock=lock).get(str(job_key))

    def read_many(self, job_keys: Sequence[JobKey], *, lock: bool
                  ) -> dict[JobKey, ForeignJob]:
        """The rows of these keys the table has, in one statement (``lock``: locked for
        the swap)."""
        if not job_keys:
            return {}
        found = self._read(self._col("id_column").in_(list(job_keys)), lock=lock)
        return {key: found[str(key)] for key in job_keys if str(key) in found}

    def _read(self, where: sa.ColumnElement[bool], *, lock: bool) -> dict[str, ForeignJob]:
        """The rows ``where`` finds, by their key's text."""
        keys = [k for k in (*FENCED_KEYS, "plan_column", "steps_column") if self._has(k)]
        query = sa.select(self._col("id_column").label("job_key"),
                          self._col("status_column").label("status"),
                          *(self._col(k).label(k) for k in keys)).where(where)
        found: dict[str, ForeignJob] = {}
        for row in self._conn.execute(for_update(self._conn.dialect.name, query, lock=lock,
                                                 skip_locked=False)):
            values = {k: v for k, v in row._mapping.items() if k != "job_key"}
            state = "" if values["status"] is None else str(values["status"])
            found[str(row.job_key)] = ForeignJob(state, self._words.get(state), values)
        return found

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """Nothing of the table's own: its mapped statuses say it all."""
        return None

    def _fenced(self, job_key: JobKey, job: ForeignJob) -> list[sa.ColumnElement[bool]]:
        read: dict[str, Any] = job.fence
        return [self._col("id_column") == job_key,
                self._col("status_column") == constant(job.state),
                *(self._col(k).is_not_distinct_from(read[k]) for k in FENCED_KEYS
                  if self._has(k))]

    def _swap(self, job_key: JobKey, job: ForeignJob, status: str,
              values: dict[str, Any]) -> str | None:
        values[self._columns["status_column"]] = constant(status)
        if self._has("generation_column"):
            values[self._columns["generation_column"]] = self._col("generation_column") + 1
        done = self._conn.execute(self._table.update().where(*self._fenced(job_key, job))
                                  .values(values))
        return status if done.rowcount == 1 else None

    def swap_many(self, action: OperatorAction, jobs: Mapping[JobKey, ForeignJob],
                  refused: dict[JobKey, str]) -> dict[JobKey, str]:
        """A chunk's retry or cancel in one UPDATE joined to the chunk's rows as read (one
        JSON parameter, ``rows.rows_as_read``): each row repeats its own fence (its
        status and fenced columns as read), each retried row carries its own resume step;
        the rows it changed. Read locked in this transaction, every row is still as read:
        a count that differs is a row that moved, and the chunk is then swapped row by
        row (inside a savepoint, so the one statement leaves nothing behind). The table
        has no rule of its own to refuse by (``refused`` stays as it is)."""
        status, values = (self._retried() if action is OperatorAction.RETRY
                          else self._cancelled())
        names = self._columns
        fenced = [k for k in FENCED_KEYS if self._has(k)]
        resume = action is OperatorAction.RETRY and self._has("resume_column")
        rows = []
        for key, job in jobs.items():
            read: dict[str, Any] = job.fence
            # The status as read, not its text: compared as the column holds it.
            row = {names["id_column"]: key, names["status_column"]: read["status"],
                   **{names[k]: read[k] for k in fenced}}
            if resume:
                row[names["resume_column"]] = self._resume_at(read)
            rows.append(row)
        seen, params = rows_as_read(self._conn, self._table, list(rows[0]), rows)
        if resume:
            values[names["resume_column"]] = seen.c[names["resume_column"]]
        values[names["status_column"]] = constant(status)
        if self._has("generation_column"):
            values[names["generation_column"]] = self._col("generation_column") + 1
        # The status kept off its index (``unindexed``), as the native chunk's: SQLite
        # would otherwise walk every row of a status and probe the JSON rows for each, and
        # InnoDB lock every row it walks; by the key each job is one row.
        where = [self._col("id_column") == seen.c[names["id_column"]],
                 unindexed(self._col("status_column")) == seen.c[names["status_column"]],
                 *(self._col(k).is_not_distinct_from(seen.c[names[k]]) for k in fenced)]
        with self._conn.begin_nested() as savepoint:
            done = self._conn.execute(self._table.update().where(*where).values(values),
                                      params)
            if done.rowcount == len(jobs):
                return dict.fromkeys(jobs, status)
            savepoint.rollback()
        swap = self.retry if action is OperatorAction.RETRY else self.cancel
        return {key: after for key, job in jobs.items()
                if (after := swap(key, job)) is not None}

    def _retried(self) -> tuple[str, dict[str, Any]]:
        values: dict[str, Any] = {}
        if self._has("attempts_column"):
            values[self._columns["attempts_column"]] = 0
        if self._has("reason_column"):
            values[self._columns["reason_column"]] = None
        return self._config.queued, values

    def _cancelled(self) -> tuple[str, dict[str, Any]]:
        values: dict[str, Any] = {}
        status = self._config.cancelled
        if status is None:
            status = self._config.failed
            if self._has("reason_column"):
                values[self._columns["reason_column"]] = \
                    OperatorStatusReason.OPERATOR_CANCEL.value
        return status, values

    def retry(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """Back to the queued status at its first unfinished step, a fresh budget."""
        status, values = self._retried()
        if self._has("resume_column"):
            values[self._columns["resume_column"]] = self._resume_at(job.fence)
        return self._swap(job_key, job, status, values)

    def cancel(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """The mapped cancelled status, else failed with ``operator_cancel``."""
        status, values = self._cancelled()
        return self._swap(job_key, job, status, values)

    def _resume_at(self, read: dict[str, Any]) -> int:
        """The first step the row's results do not record as succeeded (0 when the plan
        or the results cannot be read: rerunning is the caller's choice by retrying)."""
        try:
            plan = _json(read.get("plan_column"))
            results = _json(read.get("steps_column")) or {}
            succeeded = {int(index) for index, state in dict(results).items()
                         if state == StepState.SUCCEEDED.value}
            return first_unfinished_step(len(plan or ()), succeeded)
        except (TypeError, ValueError):
            return 0


def _json(raw: Any) -> Any:
    return json.loads(raw) if isinstance(raw, str | bytes) else raw


def open_actions(connection: Connection, config: TableConfig,
                 kinds: KindRules) -> TableActions:
    """The table's actions on ``connection`` (``kit.actions.ActionsOpener``)."""
    return TableActions(connection, config, kinds)
