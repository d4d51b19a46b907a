"""Celery (5.x) as a job source: its result table (Celery's database backend's
``celery_taskmeta``, or django-celery-results' ``django_celery_results_taskresult``; written
with ``task_track_started`` and ``result_extended``) and its Redis broker, on SQLite and
PostgreSQL. What differs between the two tables is their ``ResultTable`` (celery_tables).

- **Running**: ``status = 'STARTED'``; the kind is the task name. A row without a name
  was written without ``result_extended`` and is left alone (it has no args, queue or
  worker to judge or re-publish with).
- **Owner liveness**: the row's ``worker`` answers Celery's control ping over the broker. A
  worker that does not answer is remembered (in the broker, on its clock) and gone once it
  has been silent ``session_timeout_seconds`` across passes; a broker that cannot be
  reached decides nothing. A kind with ``max_run_seconds`` also needs that long since the
  reconciler first saw its row ``STARTED`` (a solo, gevent or eventlet pool running
  blocking code does not answer ping while it works).
- **Attempts**: ``retries + 1``; the budget is the kind's ``max_attempts``. A table without
  a retry count: one past the reconciler's own resumes of the task (or the step ledger's
  attempt, when the task counted more).
- **Fence**: (``status = 'STARTED'``, ``worker``, ``retries``) as read, and ``date_done`` as
  read where every write stamps it, in the WHERE clause of one UPDATE per batch over the
  batch's snapshots (PostgreSQL: ``FROM unnest(...)``; SQLite: one per row); a row whose
  fence no longer holds is left as it is (on PostgreSQL the scan's ``FOR UPDATE SKIP
  LOCKED`` holds the row from then on). The workers pinged come from one read of the
  ``STARTED`` rows a pass, which also finds the rows without a name.
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

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from pydantic import ConfigDict, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass
from sqlalchemy.engine import Connection

from reconciler.config.tables import SourceSettings
from reconciler.core.evidence import StepFacts
from reconciler.core.kinds import KindPolicy, KindRules
from reconciler.core.ports import (
    Candidate,
    Fence,
    JobKey,
    LivenessUnknown,
    PlannedChange,
    StuckCount,
    StuckWork,
    Unjudged,
)
from reconciler.core.vocabulary import (
    Disposition,
    JobStatus,
    Reason,
    StuckReason,
)
from reconciler.sources.celery.broker import REDIS_SCHEMES, CeleryBroker
from reconciler.sources.celery.liveness import Judgement, Running, judge
from reconciler.sources.celery.tables import (
    ResultRows,
    attempt_of,
    call_arguments,
    failure_traceback,
    queue_for,
    retries_of,
    shape_for,
)
from reconciler.sources.kit.batches import Batch, fence_of
from reconciler.sources.kit.checks import require_columns
from reconciler.sources.kit.fences import ForeignFence
from reconciler.sources.kit.shapes import Shape, UtcTimes, candidate, constant
from reconciler.sources.kit.source import ForeignSource
from reconciler.storage.sql import unnest

log = logging.getLogger("reconciler.sources.celery")
_WARNED: set[str] = set()
"""Result tables already reported for rows lacking ``result_extended`` (once a process)."""

CELERY_SERIALIZERS = ("json",)
"""The result serializers whose rows the celery source reads (args, kwargs, result): never
pickle, which would run code chosen by whoever can write the result table."""
UNEXTENDED_WHY = ("Celery wrote the row without result_extended, so a STARTED row has no "
                  "task name, args, queue or worker to judge or re-run it by")
UNEXTENDED_FIX = ("set result_extended = True (and task_track_started = True, without "
                  "which a running task has no row at all) in the Celery app's config")
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
    broker_url: str
    """The app's broker (Redis): liveness is its workers' answer to ping."""
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
        if not self.broker_url.startswith(REDIS_SCHEMES):
            raise ValueError("broker_url must be a Redis URL (redis://...): only Redis lets "
                             "the reconciler see and take back a message the broker would run "
                             f"again (got {self.broker_url.split(':')[0]}:)")
        if self.result_serializer not in CELERY_SERIALIZERS:
            raise ValueError(f"result_serializer must be one of {', '.join(CELERY_SERIALIZERS)}"
                             f" (got {self.result_serializer!r})")
        return self


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
    unacked_tag: str | None
    """The broker's delivery tag of the task's unacknowledged message, when it holds one."""


class CelerySource(ForeignSource):
    """Celery's result rows, judged by its workers' answers to ping."""

    source_name = CeleryConfig.kind

    def __init__(self, connection: Connection, config: CeleryConfig, kinds: KindRules, *,
                 lock: bool = True, broker: CeleryBroker | None = None) -> None:
        super().__init__(connection, kinds, lock=lock)
        self._config = config
        self._broker = broker or CeleryBroker(config.broker_url)
        self._shape = shape_for(config.result_table)
        self._result = ResultRows(config.result_table, self._shape)
        self._rows = self._result.sql_table
        self._judged: Judgement | None = None
        # Celery writes naive UTC: write date_done so.
        self._utc = UtcTimes(connection)
        self.declared = Shape(key=self._rows.c.task_id, kind=self._result.name,
                              locks=self._rows, scans_all_kinds=True)

    def check_schema(self) -> None:
        """The extended result table, and the packages to reach its broker."""
        require_columns(self._conn, self.source_name, self._config.result_table, None,
                        {c: c for c in self._shape.columns()})
        self._broker.check()

    # -- SQL pieces ---------------------------------------------------------- #

    def _started(self) -> list[sa.ColumnElement[bool]]:
        return [self._rows.c.status == constant("STARTED"), self._result.name.is_not(None)]

    def _judge(self) -> Judgement:
        """The broker's view of the STARTED rows, once per transaction (``judge``). The
        same read finds the rows written without ``result_extended``."""
        if self._judged is not None:
            return self._judged
        result = self._result
        started = self._conn.execute(
            sa.select(self._rows.c.task_id, result.name.label("name"), self._rows.c.worker,
                      *([result.queue.label("queue")] if result.queue is not None else []))
            .where(self._rows.c.status == constant("STARTED"))
        ).all()
        rows = [Running(r.task_id, r.name, r.worker, self._queue_of(r.name, r))
                for r in started if r.name is not None]
        if len(rows) < len(started):
            self._report_unextended(len(started) - len(rows))
        self._judged = judge(self._broker, rows, self._kinds,
                             self._config.session_timeout_seconds,
                             unextended=len(started) - len(rows))
        return self._judged

    def _queue_of(self, name: str, row: sa.Row[Any]) -> str:
        """The queue a task was sent to: the row's (selected as ``queue`` where the table
        keeps one), else where the app routes its name."""
        queue = row.queue if self._result.queue is not None else None
        return queue or queue_for(name, self._config.task_routes,
                                  self._config.task_default_queue)

    def liveness_unknown(self) -> LivenessUnknown | None:
        """Why the broker's answers were not trusted this transaction (None: they were)."""
        doubt = self._judge().doubt
        return None if doubt is None else LivenessUnknown(doubt, self._broker.where())

    def stuck_work(self) -> StuckWork:
        """The expired tasks awaiting a decision, the rows written without
        ``result_extended`` (never decided) and, while the broker's answers are doubted,
        the running tasks whose worker's liveness is unknown."""
        work = super().stuck_work()
        judged = self._judge()
        work[StuckReason.UNDECIDABLE] = StuckCount(judged.unextended)
        work[StuckReason.LIVENESS_UNKNOWN] = StuckCount(judged.unknown)
        return work

    def _report_unextended(self, count: int) -> None:
        """STARTED rows without a name were written without ``result_extended``: left
        alone, and said once a process, naming the setting (not which tasks)."""
        table = self._config.result_table
        if table in _WARNED:
            return
        _WARNED.add(table)
        log.warning("event=celery_rows_skipped count=%d missing_setting=result_extended "
                    "detail=%s", count, json.dumps(
                        f"STARTED rows without a task name are left alone: {UNEXTENDED_FIX}"))

    def unjudged(self, job_id: JobKey | None = None) -> Unjudged | None:
        """The STARTED rows without a task name (written without ``result_extended``),
        which no pass judges; for operators (``jobs explain``, ``reconciler kinds``)."""
        rows = self._rows
        query = sa.select(sa.func.count()).select_from(rows).where(
            rows.c.status == constant("STARTED"), self._result.name.is_(None))
        if job_id is not None:
            query = query.where(rows.c.task_id == str(job_id))
        count = int(self._conn.execute(query).scalar_one())
        if not count:
            return None
        return Unjudged(count, "result_extended", UNEXTENDED_WHY, UNEXTENDED_FIX)

    def _running(self, policies: Mapping[str, KindPolicy]) -> sa.Select[Any]:
        rows, result = self._rows, self._result
        gone = self._judge().gone if policies else {}
        over: sa.ColumnElement[Any] = sa.literal(-1.0, sa.Float())
        if gone:
            over = sa.case({k: sa.literal(v, sa.Float()) for k, v in gone.items()},
                           value=rows.c.task_id, else_=sa.literal(-1.0, sa.Float()))
        optional = [c.label(n) for n, c in (("queue", result.queue),) if c is not None]
        return sa.select(
            rows.c.task_id.label("job_id"), result.name.label("job_kind"), rows.c.worker,
            rows.c.date_done, result.args.label("args"), result.kwargs.label("kwargs"),
            *optional, *result.attempt_columns(self._tx.ledger, self._tx.history),
            over.label("lease_expired_seconds"),
        ).where(*self._started())

    def _expired(self, policies: Mapping[str, KindPolicy]) -> sa.ColumnElement[bool]:
        gone = self._judge().gone
        return self._rows.c.task_id.in_(sorted(gone)) if gone else sa.false()

    def _candidate(self, row: sa.Row[Any], policy: KindPolicy, steps: StepFacts | None,
                   position: bool) -> Candidate:
        judged, shape = self._judge(), self._shape
        over = judged.gone.get(row.job_id)
        arguments = call_arguments(row.args, row.kwargs, shape)
        queue = self._queue_of(row.job_kind, row)
        snapshot = CeleryFence(row.worker, retries_of(row, shape),
                               row.date_done if shape.stamps_every_write else None,
                               row.job_kind, arguments, queue, judged.unacked.get(row.job_id))
        attempts = attempt_of(row, shape)
        return candidate(
            job_id=str(row.job_id), kind=row.job_kind, policy=policy,
            fence=Fence(attempts, snapshot), attempt_count=attempts,
            max_attempts=policy.max_attempts, lease_live=over is None,
            lease_expired_seconds=over, steps=steps, session_gone=over is not None,
            position=position,
            # Without its arguments the task cannot run again: no plan to resume.
            own_plan=None if arguments is not None else (None, ()),
        )

    # -- for operators ------------------------------------------------------ #

    def status_words(self) -> Mapping[str, JobStatus]:
        """Celery's task states in this project's words."""
        return _STATUS_WORDS

    def listing(self) -> sa.Select[Any]:
        """Every result row (Celery writes one once a worker starts or ends a task)."""
        rows, result = self._rows, self._result
        retries = sa.literal(0) if result.retries is None else sa.func.coalesce(result.retries, 0)
        created = sa.null() if result.created is None else sa.type_coerce(result.created,
                                                                         sa.DateTime())
        # Only a traceback the reconciler wrote names a reason: the task's own never shows.
        ours = sa.case(*((rows.c.traceback == failure_traceback(r.value), r.value)
                         for r in Reason), else_=sa.null())
        return sa.select(
            rows.c.task_id.label("job_id"), result.name.label("job_kind"),
            rows.c.status.label("source_status"), (retries + 1).label("attempts"),
            sa.null().label("max_attempts"), ours.label("reason"), created.label("created_at"),
            sa.type_coerce(rows.c.date_done, sa.DateTime()).label("updated_at"),
            rows.c.id.label("row_number"))

    def listing_order(self, jobs: sa.Subquery) -> list[sa.ColumnElement[Any]]:
        """Newest first by the table's autoincrement ``id``: ``celery_taskmeta`` keeps no
        creation time and a ``STARTED`` row no time at all (``date_done`` is NULL until the
        task ends), while ``id`` follows the order the rows were first written."""
        return [jobs.c.row_number.desc()]

    # -- applying ------------------------------------------------------------ #

    def _swap(self, batch: Batch) -> dict[JobKey, int | None]:
        self._utc()
        judged = self._judge()
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
        rows = self._rows
        still = [] if batch.stalled is None else [batch.stalled]
        values = self._result.written(batch.reason, resume=resume)
        done = {task_id for fenced in self._fenced(changes, fences)
                for task_id in self._conn.execute(
                    rows.update().where(rows.c.status == constant("STARTED"), *fenced, *still)
                    .values(values).returning(rows.c.task_id)).scalars()}
        changed: dict[JobKey, int | None] = {}
        for change, seen in zip(changes, fences, strict=True):
            task_id = str(change.decision.job_id)
            if task_id not in done:
                continue
            attempts = change.fence.generation or 1  # the attempt just ended, as read
            batch.ledger.fence(task_id, attempts + 1)
            self._hand_over(task_id, seen, resume=resume, retries=attempts)
            changed[change.decision.job_id] = attempts
        return changed

    def _fenced(self, changes: Sequence[PlannedChange], fences: Sequence[CeleryFence]
                ) -> list[list[sa.ColumnElement[bool]]]:
        """The WHERE clauses of the swap's statements, each row only as read: one statement
        over the batch's snapshots on PostgreSQL, one per change on SQLite (in process, a
        statement per change costs no round trip)."""
        rows, result = self._rows, self._result
        if not changes:
            return []
        if self._conn.dialect.name == "postgresql":
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
            if self._shape.stamps_every_write:
                where.append(rows.c.date_done.is_not_distinct_from(stamped))
            statements.append(where)
        return statements

    def _hand_over(self, task_id: str, seen: CeleryFence, *, resume: bool,
                   retries: int) -> None:
        """After a row swapped in, before the pass commits: its held message taken out of
        the broker, then the task re-published (resume) or revoked on the live workers."""
        held_back = seen.unacked_tag is not None and not self._broker.take_unacked(
            seen.unacked_tag)
        if resume and not held_back and seen.arguments is not None:
            args, kwargs = seen.arguments
            self._broker.publish(task_id, seen.name, args=args, kwargs=kwargs,
                                 queue=seen.queue, retries=retries)
        elif not resume:
            self._broker.revoke(task_id)
