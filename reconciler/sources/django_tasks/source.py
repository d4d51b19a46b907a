"""Django's tasks framework with the database backend (django-tasks-db) as a job source, on
SQLite, PostgreSQL and MySQL/MariaDB (wherever the Django project's database is).

One shape for Django 5.2 with the django-tasks backport and for Django 6's own
``django.tasks``: django-tasks-db keeps its app label, table, migrations and statuses on
both (it imports whichever framework Django has), so nothing here depends on the version.

- **Running**: ``status = 'RUNNING'`` in ``django_tasks_database_dbtaskresult`` (only the
  rows of ``backend_name`` when the config names one); the kind is ``task_path``.
- **Owner liveness**: the backend keeps none (no heartbeat; ``worker_ids`` names workers
  that leave no trace of their own). The lease is ``started_at`` plus the kind's
  ``max_run_seconds``; a kind without one is never reclaimed on time alone.
- **Attempts**: the entries in ``worker_ids`` (each claim appends its worker's id; the
  running claim is the last), so a running task has used ``len(worker_ids)`` attempts; the
  budget is the kind's ``max_attempts``. A task's ``TaskContext.attempt`` is the same count.
- **Fence**: (``status = 'RUNNING'``, ``started_at``, ``worker_ids``) as read, and the lease
  still run out, in the WHERE clause of one UPDATE per batch over the batch's snapshots
  (PostgreSQL: ``FROM unnest(...)``; SQLite and MySQL: one per row); a row whose fence no
  longer holds is not changed, and is left as it is. On PostgreSQL and MySQL the scan's
  ``FOR UPDATE SKIP LOCKED`` holds the rows from the decision on.
- **Resume**: ``READY``, as the backend's own ``enqueue`` leaves a task: its ``db_worker``
  takes it again (``run_after`` is left as it is: its claim proved it due). ``started_at``
  and ``worker_ids`` stay as the dead claim left them, so Django's result shows the last
  attempt, and the next claim overwrites the one and appends to the other.
- **Terminalize**: ``FAILED`` as the backend's own ``set_failed`` writes it: ``finished_at``,
  ``return_value`` NULL, ``exception_class_path = 'builtins.RuntimeError'`` (importable in
  every Django project, so ``TaskResult.errors[-1].exception_class`` resolves) and a
  ``traceback`` whose last line names our reason code.

The backend's worker writes a task's end by id only (``save(update_fields=...)``), unfenced:
a worker paused past ``max_run_seconds`` that wakes up overwrites what the reconciler
wrote. docs/sources.md's late-writer table says so.

Ids are UUIDs: a native ``uuid`` on PostgreSQL and MariaDB 10.7+, 32 hex digits on SQLite
and MySQL (Django's storage); the job key is the dashed text in all, as ``TaskResult.id``
spells it. Django with ``USE_TZ`` keeps UTC in MySQL's ``DATETIME(6)``, which the
reconciler's sessions (``time_zone = '+00:00'``) compare with ``UTC_TIMESTAMP(6)`` as is.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import sqlalchemy as sa
from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as pydantic_dataclass
from sqlalchemy.engine import Connection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.visitors import InternalTraversal

from reconciler.config.tables import SourceSettings
from reconciler.core.evidence import StepFacts
from reconciler.core.kinds import KindPolicy
from reconciler.core.ports import Candidate, Fence, PlannedChange
from reconciler.core.vocabulary import Disposition, JobStatus, Reason
from reconciler.sources.kit.batches import Batch, fence_of, swapped
from reconciler.sources.kit.checks import require_columns
from reconciler.sources.kit.declaration import Declaration
from reconciler.sources.kit.fences import ForeignFence
from reconciler.sources.kit.shapes import Shape, by_kind, candidate, constant
from reconciler.sources.kit.system import Changed, Policies, Scope, System
from reconciler.storage.clock import db_now, seconds_since
from reconciler.storage.sql import unnest

EXCEPTION_CLASS_PATH = "builtins.RuntimeError"
"""The exception a terminalized task's result names: a builtin, so every Django project
resolves it without this project installed."""

COLUMNS = ("id", "status", "task_path", "backend_name", "started_at", "finished_at",
           "worker_ids", "return_value", "exception_class_path", "traceback", "enqueued_at")
_STATUS_WORDS = {"READY": JobStatus.QUEUED, "RUNNING": JobStatus.PROCESSING,
                 "SUCCESSFUL": JobStatus.COMPLETED, "FAILED": JobStatus.FAILED}


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class DjangoTasksConfig(SourceSettings):
    """``kind = "django-tasks"``: Django's tasks framework, database backend (django-tasks-db)."""

    kind: ClassVar[str] = "django-tasks"
    sql_names: ClassVar[frozenset[str]] = frozenset({"table"})
    table: str = "django_tasks_database_dbtaskresult"
    backend_name: str | None = None
    """Only rows of this backend alias; None: every backend's rows."""


def failure_traceback(reason: str) -> str:
    """The ``traceback`` text of a task the reconciler failed: its last line, as Python's
    own, says the exception and our reason code."""
    return (f"The worker running this task stopped without recording an end; "
            f"stale-claim-reconciler failed it.\n{EXCEPTION_CLASS_PATH.removeprefix('builtins.')}"
            f": {reason}\n")


@dataclass(frozen=True, slots=True)
class DjangoTasksFence(ForeignFence):
    """What a django-tasks swap repeats: the claim as read, and the lease it was judged by."""

    started_at: Any
    worker_ids: str
    """``worker_ids`` as JSON text (PostgreSQL's ``jsonb::text`` is canonical)."""
    max_run_seconds: float | None


class task_key(sa.sql.expression.ColumnElement[Any]):  # noqa: N801 - reads as SQL
    """A task's id as text, as ``TaskResult.id`` spells it, whatever the engine stores: a
    native ``uuid`` cast on PostgreSQL; on SQLite, where Django keeps 32 hex digits, the
    dashed form. Compiled per dialect, so the source's shape is built without one."""

    inherit_cache = True
    # Without its traversal the element has no cache key, and neither has any statement
    # holding it: SQLAlchemy then compiles that statement anew on every execution.
    _traverse_internals = [  # noqa: RUF012 - SQLAlchemy declares it as a list
        ("column", InternalTraversal.dp_clauseelement)]

    def __init__(self, column: sa.ColumnElement[Any]) -> None:
        self.column = column
        self.type = sa.Text()


@compiles(task_key)
def _task_key_as_text(element: task_key, compiler: Any, **kw: Any) -> str:
    return str(compiler.process(sa.cast(element.column, sa.Text()), **kw))


@compiles(task_key, "sqlite")
def _task_key_dashed(element: task_key, compiler: Any, **kw: Any) -> str:
    raw = sa.cast(element.column, sa.Text())
    parts = [sa.func.substr(raw, start, length)
             for start, length in ((1, 8), (9, 4), (13, 4), (17, 4), (21, 12))]
    dashed: sa.ColumnElement[Any] = parts[0]
    for part in parts[1:]:
        dashed = dashed.op("||")(sa.literal("-")).op("||")(part)
    return str(compiler.process(sa.func.lower(dashed), **kw))


@compiles(task_key, "mysql")
def _task_key_mysql(element: task_key, compiler: Any, **kw: Any) -> str:
    # Django keeps 32 hex digits in a CHAR(32) on MySQL, a native (dashed) UUID on
    # MariaDB 10.7+: either as the dashed text.
    raw = compiler.process(sa.cast(element.column, sa.Text()), **kw)
    dashed = raw
    for at in (9, 14, 19, 24):
        dashed = f"INSERT({dashed}, {at}, 0, '-')"
    return f"LOWER(IF(CHAR_LENGTH({raw}) = 32, {dashed}, {raw}))"


@dataclass(frozen=True, slots=True)
class DjangoTasksSql:
    """django-tasks-db's own SQL over its table, named by the config."""

    table: str
    backend_name: str | None
    tasks: sa.TableClause
    key: sa.ColumnElement[Any]

    @classmethod
    def of(cls, config: DjangoTasksConfig) -> DjangoTasksSql:
        """Its table (and the rows of ``backend_name`` when the config names one)."""
        tasks = sa.table(config.table, sa.column("id", sa.Uuid()),
                         *(sa.column(c) for c in COLUMNS[1:]))
        return cls(config.table, config.backend_name, tasks, task_key(tasks.c.id))

    def by_ids(self, keys: Sequence[Any]) -> sa.ColumnElement[bool]:
        """The tasks of these ids (dashed text) by the table's primary key, which the
        dashed ``key`` (an expression of it) is not."""
        return self.tasks.c.id.in_([uuid.UUID(str(key)) for key in keys])

    def check_schema(self, conn: Connection) -> None:
        """The backend's table and the columns this source reads and writes."""
        require_columns(conn, DjangoTasksConfig.kind, self.table, None,
                        {c: c for c in COLUMNS})

    # -- SQL pieces ---------------------------------------------------------- #

    def _lease_over(self, max_run: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
        """Seconds past ``started_at + max_run`` (negative while it runs; NULL: no lease)."""
        return seconds_since(self.tasks.c.started_at) - max_run

    def _max_run(self, policies: Policies) -> sa.ColumnElement[Any]:
        return by_kind(self.tasks.c.task_path, policies, lambda p: p.max_run_seconds)

    def _ours(self, query: sa.Select[Any]) -> sa.Select[Any]:
        if self.backend_name is not None:
            query = query.where(self.tasks.c.backend_name == self.backend_name)
        return query

    def running(self, scope: Scope, policies: Policies) -> sa.Select[Any]:
        """Every ``RUNNING`` task, its claim and how far past its lease."""
        tasks = self.tasks
        return self._ours(sa.select(
            self.key.label("job_id"), tasks.c.task_path.label("job_kind"),
            tasks.c.started_at, sa.cast(tasks.c.worker_ids, sa.Text()).label("worker_ids"),
            self._lease_over(self._max_run(policies)).label("lease_expired_seconds"),
        ).where(tasks.c.status == constant("RUNNING")))

    def expired(self, scope: Scope, policies: Policies) -> sa.ColumnElement[bool]:
        """Started longer ago than its kind's ``max_run_seconds``."""
        return sa.func.coalesce(self._lease_over(self._max_run(policies)) >= 0, False)

    def wedge_guard(self, scope: Scope, policies: Policies) -> sa.ColumnElement[bool]:
        """Only under a declared run time: a task with no lease at all is never reclaimed
        on time alone, not even as wedged."""
        return self._max_run(policies).is_not(None)

    @staticmethod
    def candidate(scope: Scope, row: sa.Row[Any], policy: KindPolicy,
                  steps: StepFacts | None, position: bool) -> Candidate:
        """One ``RUNNING`` task's facts; its claim as read is the fence."""
        over = row.lease_expired_seconds
        attempts = _attempts(row.worker_ids)
        snapshot = DjangoTasksFence(row.started_at, row.worker_ids, policy.max_run_seconds)
        return candidate(
            job_id=str(row.job_id), kind=row.job_kind, policy=policy,
            fence=Fence(attempts, snapshot), attempt_count=attempts,
            max_attempts=policy.max_attempts,
            lease_live=over is None or float(over) < 0,
            lease_expired_seconds=None if over is None or float(over) < 0 else float(over),
            steps=steps, position=position,
        )

    # -- for operators ------------------------------------------------------ #

    def listing(self, conn: Connection) -> sa.Select[Any]:
        """Every task result of the backend (of ``backend_name`` when the config names one)."""
        tasks = self.tasks
        length = {"postgresql": "jsonb_array_length", "mysql": "json_length"}.get(
            conn.dialect.name, "json_array_length")
        # Only a traceback the reconciler wrote names a reason: the task's own never shows.
        ours = sa.case(*((tasks.c.traceback == failure_traceback(r.value), r.value)
                         for r in Reason), else_=sa.null())

        def when(column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
            return sa.type_coerce(column, sa.DateTime())

        return self._ours(sa.select(
            self.key.label("job_id"), tasks.c.task_path.label("job_kind"),
            tasks.c.status.label("source_status"),
            sa.func.coalesce(getattr(sa.func, length)(tasks.c.worker_ids), 0)
            .label("attempts"),
            sa.null().label("max_attempts"), ours.label("reason"),
            when(tasks.c.enqueued_at).label("created_at"),
            when(sa.func.coalesce(tasks.c.finished_at, tasks.c.started_at,
                                  tasks.c.enqueued_at)).label("updated_at"),
            when(tasks.c.finished_at).label("finished_at")))

    # -- applying ------------------------------------------------------------ #

    def swap(self, scope: Scope, batch: Batch) -> Changed:
        """``READY`` or ``FAILED`` as the backend writes them, per lease of the batch."""
        by_lease: dict[float | None, list[PlannedChange]] = {}
        for change in batch.changes:
            lease = fence_of(change, DjangoTasksFence).max_run_seconds
            by_lease.setdefault(None if batch.wedged_after_seconds is not None else lease,
                                []).append(change)
        changed: Changed = {}
        for max_run, changes in by_lease.items():
            if batch.stalled is not None:
                still = batch.stalled
            elif max_run is None:  # pragma: no cover - a task without a lease never expires
                continue
            else:
                limit = sa.literal(float(max_run), sa.Float())
                still = sa.func.coalesce(self._lease_over(limit) >= 0, False)
            changed.update(self._swap_set(scope, batch, changes, still))
        return changed

    def _swap_set(self, scope: Scope, batch: Batch, changes: Sequence[PlannedChange],
                  still: sa.ColumnElement[bool]) -> Changed:
        """The changes of one lease swapped in, each row only as its decision read it: one
        UPDATE on PostgreSQL, one per change on SQLite and MySQL (each judged by its
        affected rows: MySQL has no ``UPDATE ... RETURNING``); the tasks changed, their
        attempts."""
        tasks = self.tasks
        fences = [fence_of(change, DjangoTasksFence) for change in changes]
        ids = [uuid.UUID(str(change.decision.job_id)) for change in changes]
        worker_ids = sa.cast(tasks.c.worker_ids, sa.Text())
        if scope.postgres:
            seen = unnest("seen", [
                ("id", sa.Uuid(), ids),
                ("started_at", sa.DateTime(timezone=True), [f.started_at for f in fences]),
                ("worker_ids", sa.Text(), [f.worker_ids for f in fences])])
            statements = [(tasks.c.id == seen.c.id,
                           tasks.c.started_at.is_not_distinct_from(seen.c.started_at),
                           worker_ids.is_not_distinct_from(seen.c.worker_ids))]
        else:
            # SQLite runs in process: a statement per change costs no round trip. MySQL's
            # rows are locked by the scan already: one short UPDATE each by primary key.
            statements = [(tasks.c.id == i, tasks.c.started_at.is_not_distinct_from(
                               f.started_at), worker_ids.is_not_distinct_from(f.worker_ids))
                          for i, f in zip(ids, fences, strict=True)]
        if batch.disposition is Disposition.RESUME:
            values: dict[str, Any] = {"status": constant("READY")}
        else:
            values = {"status": constant("FAILED"), "finished_at": db_now(),
                      "return_value": sa.null(),
                      "exception_class_path": EXCEPTION_CLASS_PATH,
                      "traceback": failure_traceback(batch.reason)}
        updates = [tasks.update().where(tasks.c.status == constant("RUNNING"), *fenced, still)
                   .values(values) for fenced in statements]
        done = swapped(scope.conn, updates, self.key,
                       [str(change.decision.job_id) for change in changes])
        changed: Changed = {}
        for change, fence in zip(changes, fences, strict=True):
            if str(change.decision.job_id) in done:
                attempts = _attempts(fence.worker_ids)
                batch.ledger.fence(change.decision.job_id, attempts + 1)
                changed[change.decision.job_id] = attempts
        return changed


def declare(config: DjangoTasksConfig) -> System:
    """django-tasks-db's task results, leased by their kind's ``max_run_seconds``."""
    sql = DjangoTasksSql.of(config)
    return System(
        # Django stores UTC: its timestamps are read and written so.
        shape=Shape(key=sql.key, kind=sql.tasks.c.task_path, locks=sql.tasks,
                    scans_all_kinds=True, naive_utc="scan", lock_by=sql.by_ids,
                    # A task keeps when it started, not a lease: max_run_seconds is its lease.
                    leases_own=False),
        running=sql.running, expired=sql.expired, candidate=sql.candidate, swap=sql.swap,
        check_schema=sql.check_schema, listing=sql.listing, status_words=_STATUS_WORDS,
        wedge_guard=sql.wedge_guard)


DECLARATION = Declaration(DjangoTasksConfig, declare)


def _attempts(worker_ids: str | None) -> int:
    """Claims so far: the entries of ``worker_ids`` (JSON text)."""
    try:
        ids = json.loads(worker_ids or "[]")
    except ValueError:
        return 1
    return len(ids) if isinstance(ids, list) and ids else 1
