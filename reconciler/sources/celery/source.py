"""Celery (5.x) as a job source: its result table (Celery's database backend's
``celery_taskmeta``, or django-celery-results' ``django_celery_results_taskresult``; written
with ``task_track_started`` and ``result_extended``) and its Redis broker, on SQLite,
PostgreSQL and MySQL/MariaDB. What differs between the two tables is their
``ResultTable`` (celery_tables).

- **Running**: ``status = 'STARTED'``; the kind is the task name. A row without a name
  was written without ``result_extended`` and is left alone (it has no args, queue or
  worker to judge or re-publish with).
- **Owner liveness**: a worker process holding the task, not the row's ``worker`` name
  answering (``holders``: a worker restarted under its old node name is another process).
  A task held by none is remembered (in the broker, on its clock) and gone once held by
  none ``session_timeout_seconds`` across passes; a broker that cannot be reached decides
  nothing. A kind with ``max_run_seconds`` also needs that long since the reconciler first
  saw its row ``STARTED`` (a solo, gevent or eventlet pool running blocking code does not
  answer while it works).
- **Attempts**: ``retries + 1``; the budget is the kind's ``max_attempts``. A table without
  a retry count: one past the reconciler's own resumes of the task (or the step ledger's
  attempt, when the task counted more). ``jobs list`` / ``jobs show`` show only what the
  row keeps: ``retries + 1``, or unknown on django-celery-results (no retry count) and on
  a ``celery_taskmeta`` row written without ``result_extended`` (``retries`` NULL).
- **Fence**: (``status = 'STARTED'``, ``worker``, ``retries``) as read, and ``date_done`` as
  read where every write stamps it, in the WHERE clause of one UPDATE per batch over the
  batch's snapshots (PostgreSQL: ``FROM unnest(...)``; SQLite and MySQL: one per row); a
  row whose fence no longer holds is left as it is (on PostgreSQL and MySQL the scan's
  ``FOR UPDATE SKIP LOCKED`` holds the row from then on). The workers pinged come from
  one read of the ``STARTED`` rows a pass, which also finds the rows without a name.
- **Resume**: the row in Celery's own ``RETRY`` shape (``result`` an exception naming our
  reason, as its retry writes one), then the task re-published through Celery's
  ``send_task`` with the same id, name, args, kwargs and queue and ``retries + 1``. Args
  the table does not hold faithfully (a cut or custom repr) make the task unresumable. Where
  the broker still holds the message unacknowledged (``task_acks_late``, or a kill inside
  the prefork ack window) it is taken out first, so the broker never runs it a second
  time; if the broker put it back on its queue already, nothing is published.
- **Terminalize**: ``FAILURE`` with ``date_done`` and ``WorkerLostError`` naming our
  reason, so ``AsyncResult(id).get()`` raises at once; an unacknowledged message is taken
  out of the broker and the task revoked on the live workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from pydantic import ConfigDict, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass
from sqlalchemy.engine import Connection

from reconciler.config.settings import given_or_read
from reconciler.config.tables import SourceSettings
from reconciler.core.evidence import StepFacts
from reconciler.core.kinds import KindPolicy
from reconciler.core.ports import Candidate, Fence, JobKey, PlannedChange, Unjudged
from reconciler.core.vocabulary import Disposition, JobStatus, Reason
from reconciler.sources.celery.broker import REDIS_SCHEMES, CeleryBroker
from reconciler.sources.celery.liveness import (
    UNEXTENDED_FIX,
    UNEXTENDED_WHY,
    CeleryLiveness,
    Judgement,
)
from reconciler.sources.celery.tables import (
    ResultRows,
    ResultTable,
    attempt_of,
    call_arguments,
    failure_traceback,
    retries_of,
    shape_for,
)
from reconciler.sources.kit.batches import Batch, fence_of, swapped
from reconciler.sources.kit.checks import require_columns
from reconciler.sources.kit.declaration import Declaration
from reconciler.sources.kit.fences import ForeignFence
from reconciler.sources.kit.shapes import Shape, candidate, constant
from reconciler.sources.kit.system import Changed, Policies, Scope, System
from reconciler.storage.sql import unnest

CELERY_SERIALIZERS = ("json",)
"""The result serializers whose rows the celery source reads (args, kwargs, result): never
pickle, which would run code chosen by whoever can write the result table."""
_STATUS_WORDS = {"PENDING": JobStatus.QUEUED, "RECEIVED": JobStatus.QUEUED,
                 "RETRY": JobStatus.QUEUED, "STARTED": JobStatus.PROCESSING,
                 "SUCCESS": JobStatus.COMPLETED, "FAILURE": JobStatus.FAILED,
                 "REVOKED": JobStatus.CANCELLED}


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class CeleryConfig(SourceSettings):
    """``kind = "celery"``: Celery's database result backend, liveness over its broker."""

    kind: ClassVar[str] = "celery"
    from_settings: ClassVar[frozenset[str]] = frozenset({"session_timeout_seconds"})
    sql_names: ClassVar[frozenset[str]] = frozenset({"result_table"})
    string_tables: ClassVar[frozenset[str]] = frozenset({"task_routes"})
    broker_url: str | None = None
    """The app's broker (Redis): liveness is its workers' answer to ping."""
    broker_url_file: str | None = None
    """A file holding ``broker_url`` on one line (a password kept out of the config)."""
    result_table: str = "celery_taskmeta"
    """``celery_taskmeta`` (Celery's own) or ``django_celery_results_taskresult``."""
    result_serializer: str = "json"
    task_default_queue: str = "celery"
    task_routes: dict[str, str] = field(default_factory=dict)
    """Task name glob -> queue, as the app's ``task_routes``: where a table that keeps no
    queue (django-celery-results) has a task re-published; else ``task_default_queue``."""
    session_timeout_seconds: float = 30.0
    """A worker silent to ping this long, across passes, is gone (the
    ``session_timeout_seconds`` setting)."""

    @model_validator(mode="after")
    def _supported(self) -> CeleryConfig:
        # Only the scheme is named back: a broker URL may hold a password.
        if not self.url.startswith(REDIS_SCHEMES):
            raise ValueError("broker_url must be a Redis URL (redis://...): only Redis lets "
                             "the reconciler see and take back a message the broker would run "
                             f"again (got {self.url.split(':')[0]}:)")
        if self.result_serializer not in CELERY_SERIALIZERS:
            raise ValueError(f"result_serializer must be one of {', '.join(CELERY_SERIALIZERS)}"
                             f" (got {self.result_serializer!r})")
        return self

    @property
    def url(self) -> str:
        """The broker URL, read from ``broker_url_file`` where the config names one."""
        return given_or_read(self.broker_url, self.broker_url_file, "broker_url")


@dataclass(frozen=True, slots=True)
class CeleryFence(ForeignFence):
    """What a celery swap repeats, and what a resume re-publishes."""

    worker: str | None
    retries: int | None
    stamped: datetime | str | None
    """``date_done`` as read, where every write of the row stamps it (else None)."""
    name: str
    arguments: tuple[list[Any], dict[str, Any]] | None
    """args and kwargs as sent; None: the table does not hold them faithfully."""
    queue: str


@dataclass(frozen=True, slots=True)
class CelerySql:
    """Celery's result table as SQL, and its broker's liveness (the declared one)."""

    table: str
    shape: ResultTable
    result: ResultRows
    liveness: CeleryLiveness

    @classmethod
    def of(cls, config: CeleryConfig) -> CelerySql:
        """The configured result table and the app's broker."""
        shape = shape_for(config.result_table)
        result = ResultRows(config.result_table, shape)
        return cls(config.result_table, shape, result, CeleryLiveness(
            CeleryBroker(config.url), result, config.session_timeout_seconds,
            config.task_routes, config.task_default_queue))

    @property
    def rows(self) -> sa.TableClause:
        """The result table."""
        return self.result.sql_table

    def check_schema(self, conn: Connection) -> None:
        """The extended result table (the broker is the liveness's to check)."""
        require_columns(conn, CeleryConfig.kind, self.table, None,
                        {c: c for c in self.shape.columns()})

    # -- SQL pieces ---------------------------------------------------------- #

    def unjudged(self, conn: Connection, job_id: JobKey | None) -> Unjudged | None:
        """The STARTED rows without a task name (written without ``result_extended``),
        which no pass judges; for operators (``jobs explain``, ``reconciler kinds``)."""
        rows = self.rows
        query = sa.select(sa.func.count()).select_from(rows).where(
            rows.c.status == constant("STARTED"), self.result.name.is_(None))
        if job_id is not None:
            query = query.where(rows.c.task_id == str(job_id))
        count = int(conn.execute(query).scalar_one())
        if not count:
            return None
        return Unjudged(count, "result_extended", UNEXTENDED_WHY, UNEXTENDED_FIX)

    def running(self, scope: Scope, policies: Policies) -> sa.Select[Any]:
        """Every STARTED row with a task name, and how far past its worker's silence."""
        rows, result = self.rows, self.result
        gone = _judged(scope).gone if policies else {}
        over: sa.ColumnElement[Any] = sa.literal(-1.0, sa.Float())
        if gone:
            over = sa.case({k: sa.literal(v, sa.Float()) for k, v in gone.items()},
                           value=rows.c.task_id, else_=sa.literal(-1.0, sa.Float()))
        optional = [c.label(n) for n, c in (("queue", result.queue),) if c is not None]
        return sa.select(
            rows.c.task_id.label("job_id"), result.name.label("job_kind"), rows.c.worker,
            rows.c.date_done, result.args.label("args"), result.kwargs.label("kwargs"),
            *optional, *result.attempt_columns(scope.ledger, scope.history),
            over.label("lease_expired_seconds"),
        ).where(rows.c.status == constant("STARTED"), result.name.is_not(None))

    def expired(self, scope: Scope, policies: Policies) -> sa.ColumnElement[bool]:
        """The tasks the broker's verdict found gone."""
        gone = _judged(scope).gone
        return self.rows.c.task_id.in_(sorted(gone)) if gone else sa.false()

    def candidate(self, scope: Scope, row: sa.Row[Any], policy: KindPolicy,
                  steps: StepFacts | None, position: bool) -> Candidate:
        """One STARTED row's facts; its worker, retries and stamp are the fence."""
        judged, shape = _judged(scope), self.shape
        over = judged.gone.get(row.job_id)
        arguments = call_arguments(row.args, row.kwargs, shape)
        queue = self.liveness.queue_of(row.job_kind, row)
        snapshot = CeleryFence(row.worker, retries_of(row, shape),
                               row.date_done if shape.stamps_every_write else None,
                               row.job_kind, arguments, queue)
        attempts = attempt_of(row, shape)
        return candidate(
            job_id=str(row.job_id), kind=row.job_kind, policy=policy,
            fence=Fence(attempts, snapshot), attempt_count=attempts,
            max_attempts=policy.max_attempts, lease_live=over is None,
            lease_expired_seconds=over, steps=steps, session_gone=over is not None,
            position=position, owner=judged.owner(str(row.job_id), row.worker),
            # Without its arguments the task cannot run again: no plan to resume.
            own_plan=None if arguments is not None else (None, ()),
        )

    # -- for operators ------------------------------------------------------ #

    def listing(self, conn: Connection) -> sa.Select[Any]:
        """Every result row (Celery writes one once a worker starts or ends a task)."""
        rows, result = self.rows, self.result
        # Attempts as the row keeps them: ``retries + 1`` where the table has the column and
        # the row a value (result_extended), else unknown (NULL), never a made-up 1.
        attempts = sa.null() if result.retries is None else result.retries + 1
        created = sa.null() if result.created is None else sa.type_coerce(result.created,
                                                                         sa.DateTime())
        # Only a traceback the reconciler wrote names a reason: the task's own never shows.
        ours = sa.case(*((rows.c.traceback == failure_traceback(r.value), r.value)
                         for r in Reason), else_=sa.null())
        return sa.select(
            rows.c.task_id.label("job_id"), result.name.label("job_kind"),
            rows.c.status.label("source_status"), attempts.label("attempts"),
            sa.null().label("max_attempts"), ours.label("reason"), created.label("created_at"),
            sa.type_coerce(rows.c.date_done, sa.DateTime()).label("updated_at"),
            # Celery stamps date_done on every state it stores; it is a finish only on an
            # ended row, which is the only kind the views read it for.
            sa.type_coerce(rows.c.date_done, sa.DateTime()).label("finished_at"),
            rows.c.id.label("row_number"))

    # -- applying ------------------------------------------------------------ #

    def swap(self, scope: Scope, batch: Batch) -> Changed:
        """The rows still as read, in Celery's RETRY or FAILURE shape, each then handed
        over to the broker (re-published or revoked)."""
        judged = _judged(scope)
        if not judged.may_swap:
            return {}  # a broker that does not answer, or not the app's: nothing is written
        resume = batch.disposition is Disposition.RESUME
        wedged = batch.wedged_after_seconds is not None
        # An expired task whose worker answered since is not gone any more; a task without
        # its arguments is never decided resumable.
        held = [(change, fence_of(change, CeleryFence)) for change in batch.changes
                if wedged or str(change.decision.job_id) in judged.gone]
        held = [(c, f) for c, f in held if not (resume and f.arguments is None)]
        changes, fences = [c for c, _ in held], [f for _, f in held]
        rows = self.rows
        still = [] if batch.stalled is None else [batch.stalled]
        values = self.result.written(batch.reason, resume=resume)
        done = swapped(scope.conn, [
            rows.update().where(rows.c.status == constant("STARTED"), *fenced, *still)
            .values(values) for fenced in self._fenced(scope, changes, fences)],
            rows.c.task_id, [str(change.decision.job_id) for change in changes])
        changed: Changed = {}
        # The broker's copies of the swapped tasks' messages, read once for the batch (a
        # wedged task's too: its live worker's later death must not hand it back either).
        tags = self.liveness.broker.unacked(done) if done else {}
        for change, seen in zip(changes, fences, strict=True):
            task_id = str(change.decision.job_id)
            if task_id not in done:
                continue
            attempts = change.fence.generation or 1  # the attempt just ended, as read
            batch.ledger.fence(task_id, attempts + 1)
            self._hand_over(task_id, seen, tags.get(task_id), resume=resume,
                            retries=attempts)
            changed[change.decision.job_id] = attempts
        return changed

    def _fenced(self, scope: Scope, changes: Sequence[PlannedChange],
                fences: Sequence[CeleryFence]) -> list[list[sa.ColumnElement[bool]]]:
        """The WHERE clauses of the swap's statements, each row only as read: one statement
        over the batch's snapshots on PostgreSQL, one per change on SQLite (in process, a
        statement per change costs no round trip) and MySQL (no ``UPDATE ... RETURNING``:
        each judged by its affected rows, ``kit.batches.swapped``)."""
        rows, result = self.rows, self.result
        if not changes:
            return []
        if scope.postgres:
            seen = unnest("seen", [
                ("task_id", sa.Text(), [str(c.decision.job_id) for c in changes]),
                ("worker", sa.Text(), [f.worker for f in fences]),
                ("retries", sa.Integer(), [f.retries for f in fences]),
                ("stamped", sa.DateTime(timezone=True), [f.stamped for f in fences])])
            snapshots = [(rows.c.task_id == seen.c.task_id, seen.c.worker, seen.c.retries,
                          seen.c.stamped)]
        else:
            snapshots = [(rows.c.task_id == str(c.decision.job_id), f.worker, f.retries,
                          f.stamped) for c, f in zip(changes, fences, strict=True)]
        statements = []
        for key, worker, retries, stamped in snapshots:
            where = [key, rows.c.worker.is_not_distinct_from(worker)]
            if result.retries is not None:
                where.append(result.retries.is_not_distinct_from(retries))
            if self.shape.stamps_every_write:
                where.append(rows.c.date_done.is_not_distinct_from(stamped))
            statements.append(where)
        return statements

    def _hand_over(self, task_id: str, seen: CeleryFence, unacked_tag: str | None, *,
                   resume: bool, retries: int) -> None:
        """After a row swapped in, before the pass commits: its held message
        (``unacked_tag``: the broker's delivery tag of it, where it holds one) taken out
        of the broker, then the task re-published (resume) or revoked on the live
        workers."""
        broker = self.liveness.broker
        held_back = unacked_tag is not None and not broker.take_unacked(unacked_tag)
        if resume and not held_back and seen.arguments is not None:
            args, kwargs = seen.arguments
            broker.publish(task_id, seen.name, args=args, kwargs=kwargs,
                           queue=seen.queue, retries=retries)
        elif not resume:
            broker.revoke(task_id)


def _judged(scope: Scope) -> Judgement:
    """The broker's verdict the kit read for this transaction."""
    if not isinstance(scope.verdict, Judgement):  # pragma: no cover - the kit's mistake
        raise TypeError("the celery source's functions need the broker's verdict")
    return scope.verdict


def by_row_number(jobs: sa.Subquery) -> list[sa.ColumnElement[Any]]:
    """Newest first by the table's autoincrement ``id``: ``celery_taskmeta`` keeps no
    creation time and a ``STARTED`` row no time at all (``date_done`` is NULL until the
    task ends), while ``id`` follows the order the rows were first written."""
    return [jobs.c.row_number.desc()]


def declare(config: CeleryConfig) -> System:
    """Celery's result rows, judged by its workers' answers to ping."""
    sql = CelerySql.of(config)
    return System(
        # Celery writes naive UTC: date_done is written so.
        shape=Shape(key=sql.rows.c.task_id, kind=sql.result.name, locks=sql.rows,
                    scans_all_kinds=True, naive_utc="swap"),
        running=sql.running, expired=sql.expired, candidate=sql.candidate, swap=sql.swap,
        check_schema=sql.check_schema, listing=sql.listing, status_words=_STATUS_WORDS,
        listing_order=by_row_number, unjudged=sql.unjudged, liveness=sql.liveness)


DECLARATION = Declaration(CeleryConfig, declare)
