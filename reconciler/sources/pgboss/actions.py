"""Operator retry and cancel on pg-boss (10.x), as its own ``retry``, ``resume`` and
``cancel`` write them, each naming the job's queue (its partition).

- **retry**: a ``failed`` job goes to ``retry`` (its ``boss.retry``), a ``cancelled`` one to
  ``created`` (its ``boss.resume``); runnable now (``start_after = now()``), with a fresh
  budget: ``retry_count = 0`` and ``started_on`` cleared, so its next fetch counts the
  first attempt again (pg-boss's own retry adds one to ``retry_limit`` instead).
- **cancel** (``created``, ``retry`` or ``active``): ``cancelled``, ``completed_on = now()``,
  as its ``boss.cancel``. pg-boss cannot stop a running handler: its worker runs on, and
  its ``complete`` or ``fail`` afterwards changes nothing (they take ``active`` jobs only).

Fenced on the job as read (state, ``started_on``, ``retry_count``); in a ``stately`` queue a
retry that would give the queue a second job of the same state and key is refused
(``pgboss_stately_conflict``), as pg-boss's unique index would refuse it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import INTERVAL, UUID
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from reconciler.core.kinds import KindRules
from reconciler.core.vocabulary import JobKey, JobStatus, OperatorAction
from reconciler.sources.kit.actions import (
    ForeignJob,
    SystemRefusal,
    locked,
    one_by_one,
    read_locked,
)
from reconciler.sources.kit.rows import rows_as_read
from reconciler.sources.kit.shapes import constant
from reconciler.sources.pgboss.source import HOLD_PUSHBACK, PgBossConfig
from reconciler.storage.clock import db_now

WORDS = {"created": JobStatus.QUEUED, "retry": JobStatus.QUEUED,
         "active": JobStatus.PROCESSING, "completed": JobStatus.COMPLETED,
         "cancelled": JobStatus.CANCELLED, "failed": JobStatus.FAILED}
"""pg-boss's job states in this project's words."""

STATELY_CONFLICT = "pgboss_stately_conflict"
"""The refusal of a retry that a stately queue's one-job-per-state-and-key rule forbids."""


class PgBossActions:
    """Retry and cancel on pg-boss's ``job`` table, on one transaction."""

    limits: Mapping[OperatorAction, str] = {
        OperatorAction.HOLD: "its expiry is pushed back while held: pg-boss's own "
                             "maintenance neither fails nor retries it until the hold is "
                             "lifted",
        OperatorAction.CANCEL: "pg-boss cannot stop a running handler: it runs on, and "
                               "its completion changes nothing",
    }

    def __init__(self, connection: Connection, config: PgBossConfig,
                 kinds: KindRules) -> None:
        self._conn = connection
        self._jobs = sa.table(
            "job", sa.column("id", UUID(as_uuid=False)), sa.column("name"),
            sa.column("state"), sa.column("started_on"), sa.column("retry_count"),
            sa.column("start_after"), sa.column("completed_on"),
            sa.column("expire_in", INTERVAL), schema=config.schema)

    def _by_id(self, job_key: JobKey) -> sa.ColumnElement[bool]:
        return self._jobs.c.id == sa.cast(sa.literal(str(job_key)), UUID(as_uuid=False))

    def read(self, job_key: JobKey, *, lock: bool) -> ForeignJob | None:
        """The job's queue, state, start and retries, its row locked with ``lock``."""
        jobs = self._jobs
        try:
            with self._conn.begin_nested():
                return read_locked(self._conn, sa.select(
                    jobs.c.name, sa.cast(jobs.c.state, sa.Text()).label("state"),
                    jobs.c.started_on, jobs.c.retry_count).where(self._by_id(job_key)),
                    "state", WORDS, lock=lock)
        except sa.exc.DataError:  # not a UUID: no job of pg-boss's
            return None

    def read_many(self, job_keys: Sequence[JobKey], *, lock: bool
                  ) -> dict[JobKey, ForeignJob]:
        """The jobs of these ids pg-boss has (an id that is no UUID names none), in one
        statement, locked with ``lock``."""
        ids = {str(key): key for key in job_keys if _is_uuid(str(key))}
        if not ids:
            return {}
        jobs = self._jobs
        query = sa.select(sa.cast(jobs.c.id, sa.Text()).label("id"), jobs.c.name,
                          sa.cast(jobs.c.state, sa.Text()).label("state"), jobs.c.started_on,
                          jobs.c.retry_count).where(
            jobs.c.id.in_([sa.cast(sa.literal(i), UUID(as_uuid=False)) for i in ids]))
        found = {}
        for row in self._conn.execute(locked(query, lock)):
            fence = {k: v for k, v in row._mapping.items() if k != "id"}
            found[ids[str(row.id)]] = ForeignJob(str(row.state), WORDS.get(str(row.state)),
                                                 fence)
        return found

    def swap_many(self, action: OperatorAction, jobs: Mapping[JobKey, ForeignJob],
                  refused: dict[JobKey, str]) -> dict[JobKey, str]:
        """A chunk's retry or cancel: one UPDATE per state it writes (``retry`` from
        failed, ``created`` from cancelled, or ``cancelled``), joined to its jobs as read
        (one JSON parameter, ``kit.rows.rows_as_read``), so each row repeats its own fence
        at the cost of one. A stately queue's unique index refusing one row, or a count
        that differs (a row that moved), swaps that statement's jobs one by one instead,
        inside a savepoint, so that each refusal is its job's own."""
        after: dict[JobKey, str] = {}
        jobs_table = self._jobs
        for state, group in self._by_target(action, jobs).items():
            values = ({"completed_on": db_now()} if action is OperatorAction.CANCEL else
                      {"retry_count": 0, "started_on": None, "start_after": db_now(),
                       "completed_on": None})
            rows = [{"name": job.fence["name"], "id": str(key), "state": job.fence["state"],
                     "started_on": job.fence["started_on"],
                     "retry_count": job.fence["retry_count"]}
                    for key, job in group.items()]
            seen, params = rows_as_read(self._conn, jobs_table, list(rows[0]), rows)
            # The queue first: pg-boss partitions ``job`` by it.
            fenced = [jobs_table.c.name == seen.c.name, jobs_table.c.id == seen.c.id,
                      jobs_table.c.state == seen.c.state,
                      jobs_table.c.started_on.is_not_distinct_from(seen.c.started_on),
                      jobs_table.c.retry_count == seen.c.retry_count]
            try:
                with self._conn.begin_nested() as savepoint:
                    done = self._conn.execute(
                        jobs_table.update().where(*fenced)
                        .values(state=constant(state), **values), params)
                    if done.rowcount == len(group):
                        after.update(dict.fromkeys(group, state))
                        continue
                    savepoint.rollback()
            except IntegrityError:
                pass  # the savepoint rolled the statement back: one by one below
            after.update(one_by_one(self, action, group, refused))
        return after

    @staticmethod
    def _by_target(action: OperatorAction, jobs: Mapping[JobKey, ForeignJob]
                   ) -> dict[str, dict[JobKey, ForeignJob]]:
        """The jobs by the state the action writes."""
        groups: dict[str, dict[JobKey, ForeignJob]] = {}
        for key, job in jobs.items():
            state = ("cancelled" if action is OperatorAction.CANCEL
                     else "created" if job.fence["state"] == "cancelled" else "retry")
            groups.setdefault(state, {})[key] = job
        return groups

    def refuses(self, action: OperatorAction, job: ForeignJob) -> str | None:
        """Nothing of pg-boss's own beyond its states."""
        return None

    def _fenced(self, job_key: JobKey, job: ForeignJob) -> list[sa.ColumnElement[bool]]:
        """The job as read: its queue (the partition), id, state, start and retries."""
        jobs, read = self._jobs, job.fence
        return [jobs.c.name == read["name"], self._by_id(job_key),
                sa.cast(jobs.c.state, sa.Text()) == read["state"],
                jobs.c.started_on.is_not_distinct_from(read["started_on"]),
                jobs.c.retry_count == read["retry_count"]]

    def _swap(self, job_key: JobKey, job: ForeignJob, state: str,
              values: dict[str, Any]) -> str | None:
        statement = (self._jobs.update().where(*self._fenced(job_key, job))
                     .values(state=constant(state), **values))
        with self._conn.begin_nested():
            done = self._conn.execute(statement)
        return state if done.rowcount == 1 else None

    def retry(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """``retry`` from failed, ``created`` from cancelled; runnable now, fresh count."""
        state = "created" if job.fence["state"] == "cancelled" else "retry"
        try:
            return self._swap(job_key, job, state, {
                "retry_count": 0, "started_on": None, "start_after": db_now(),
                "completed_on": None})
        except IntegrityError:
            # The savepoint rolled the swap back; the queue's unique index keeps its shape.
            raise SystemRefusal(STATELY_CONFLICT) from None

    def cancel(self, job_key: JobKey, job: ForeignJob) -> str | None:
        """``cancelled``, as pg-boss's cancel writes it."""
        return self._swap(job_key, job, "cancelled", {"completed_on": db_now()})

    def hold_recovery(self, job_key: JobKey, job: ForeignJob, *, held: bool) -> None:
        """The job's ``expire_in`` pushed back by ``HOLD_PUSHBACK`` (``held``), or given
        back: pg-boss's maintenance expires a job ``started_on + expire_in`` after it
        started, so while held it never does; the push is added and taken away, never
        stored, and pg-boss copies ``expire_in`` into every later run of the job, so a
        push is found and taken back whatever became of the job meanwhile."""
        jobs, push = self._jobs, sa.cast(sa.literal(HOLD_PUSHBACK), INTERVAL)
        pushed = jobs.c.expire_in >= push
        self._conn.execute(
            jobs.update().where(jobs.c.name == job.fence["name"], self._by_id(job_key),
                                sa.not_(pushed) if held else pushed)
            .values(expire_in=jobs.c.expire_in + push if held else jobs.c.expire_in - push))


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def open_actions(connection: Connection, config: PgBossConfig,
                 kinds: KindRules) -> PgBossActions:
    """pg-boss's actions on ``connection`` (``kit.actions.ActionsOpener``)."""
    return PgBossActions(connection, config, kinds)
