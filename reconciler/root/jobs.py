"""Jobs as operators see them, through the configured source (``reconciler jobs ...``):
the operator read model the command line's and the console's roles both assemble (a
composition of this project's store, its audit and the configured source, so it lives
in the root beside them, not among the sources).

The native source's jobs are this project's ``job_runs`` (the store's read views and
operator actions). A foreign source's jobs are its system's own rows, read through its
``listing``: the system's status (and its status in this project's words), kind and
attempts, and the audit's decisions about the job. Operator actions go only where the
source's registry entry lists them; the command line refuses the others by name.

Privacy as everywhere: a foreign system's error field may hold its own error messages, so
only a reason code of ours is ever shown from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from reconciler.config.registry import DEFAULT_SOURCE, is_native
from reconciler.config.tables import SourceSettings
from reconciler.core.evidence import PlanStep, StepFacts, parse_plan
from reconciler.core.job_story import JobDetail, LastMove, aware, read_job
from reconciler.core.kinds import KindRules
from reconciler.core.ports import OperatorStore, SourceJobs, Unjudged
from reconciler.core.vocabulary import JobKey, JobStatus, OperatorStatusReason, Reason
from reconciler.root.checks import open_foreign_source
from reconciler.sources.kit.shapes import step_results
from reconciler.sources.kit.source import DeclaredSource
from reconciler.sources.kit.system import Wanted
from reconciler.storage.audit import AuditHistory
from reconciler.storage.engines import read_only
from reconciler.storage.job_timeline import foreign_timeline, native_timeline
from reconciler.storage.operator_record import held_among, last_moves
from reconciler.storage.step_ledger import PassLedger

_REASONS = frozenset(r.value for r in Reason) | frozenset(
    r.value for r in OperatorStatusReason)
T = TypeVar("T")


def open_jobs(engine: Engine, source: SourceSettings, kinds: KindRules,
              native: OperatorStore) -> SourceJobs:
    """The configured source's jobs for operators; ``native`` is the store of this
    project's own tables (used as is for the native source)."""
    if is_native(source):
        return NativeJobs(engine, native)
    return ForeignJobs(engine, source, kinds)


def decisions_about(conn: Connection, source_name: str, job_id: JobKey,
                    limit: int) -> list[dict[str, Any]]:
    """The audit's decisions about one job of one source, newest first."""
    return AuditHistory(read_only(conn), source_name).about(job_id, limit)


class NativeJobs:
    """This project's own jobs: the store's read views and operator actions."""

    def __init__(self, engine: Engine, store: OperatorStore) -> None:
        self._engine = engine
        self._store = store

    def list_jobs(self, status: str | None, limit: int) -> list[JobDetail]:
        """Newest first, optionally of one status."""
        return self._store.list_jobs(status, limit)

    def get_job(self, job_id: JobKey) -> JobDetail | None:
        """One job, or None (an id that is no whole number names none)."""
        return self._store.get_job(job_id) if isinstance(job_id, int) else None

    def decisions_about(self, job_id: JobKey, limit: int) -> list[dict[str, Any]]:
        """The audit's decisions about the job, newest first."""
        with self._engine.connect() as conn:
            return decisions_about(conn, DEFAULT_SOURCE, job_id, limit)

    def timeline(self, job_id: JobKey, limit: int) -> list[dict[str, Any]]:
        """Its attempts, its steps' latest runs, the audit's decisions and the actions."""
        if not isinstance(job_id, int):
            return []
        with self._engine.connect() as conn:
            return native_timeline(read_only(conn), job_id, limit)

    def operator_action(self, job_id: JobKey, action: str) -> tuple[bool, str | None]:
        """Hold, unhold, retry or cancel, fenced as the store does it."""
        if not isinstance(job_id, int):
            return False, "no_such_job"
        return self._store.operator_action(job_id, action)

    def unjudged(self, job_id: JobKey | None = None) -> Unjudged | None:
        """None: a pass judges every processing job of this project's own."""
        return None


class ForeignJobs:
    """A foreign system's jobs, read through its source on a read-only connection."""

    def __init__(self, engine: Engine, source: SourceSettings, kinds: KindRules) -> None:
        self._engine = engine
        self._source = source
        self._kinds = kinds
        self._name = source.kind

    def list_jobs(self, status: str | None, limit: int) -> list[JobDetail]:
        """Newest first, as the source orders its jobs (``listing_order``)."""
        def read(source: DeclaredSource) -> list[JobDetail]:
            words = source.status_words()
            raws = None if status is None else frozenset(
                raw for raw, word in words.items() if word.value == status) or frozenset({status})
            jobs = source.listing(Wanted(limit=limit, statuses=raws)).subquery()
            query = sa.select(jobs).order_by(*source.listing_order(jobs)).limit(limit)
            if raws is not None:
                query = query.where(jobs.c.source_status.in_(sorted(raws)))
            return self._details(source, list(source.connection.execute(query)))

        return self._with_source(read)

    def get_job(self, job_id: JobKey) -> JobDetail | None:
        """One job as its system spells its id, or None."""
        def read(source: DeclaredSource) -> JobDetail | None:
            jobs = source.listing(Wanted(job_id=str(job_id))).subquery()
            row = source.connection.execute(
                sa.select(jobs).where(sa.cast(jobs.c.job_id, sa.String()) == str(job_id))
            ).first()
            return None if row is None else self._details(source, [row])[0]

        return self._with_source(read)

    def decisions_about(self, job_id: JobKey, limit: int) -> list[dict[str, Any]]:
        """The audit's decisions about the job, newest first."""
        with self._engine.connect() as conn:
            return decisions_about(conn, self._name, job_id, limit)

    def timeline(self, job_id: JobKey, limit: int) -> list[dict[str, Any]]:
        """Its steps as the step ledger keeps them, the audit's decisions and the actions
        (its attempts are its system's own history)."""
        with self._engine.connect() as conn:
            return foreign_timeline(read_only(conn), self._name, job_id, limit)

    def operator_action(self, job_id: JobKey, action: str) -> tuple[bool, str | None]:
        """None reach a foreign system here: the command line refuses them by name."""
        return False, "not_supported"

    def unjudged(self, job_id: JobKey | None = None) -> Unjudged | None:
        """The running jobs (``job_id``: only that one) the source cannot judge, and why."""
        return self._with_source(lambda source: source.unjudged(job_id))

    def _with_source(self, read: Callable[[DeclaredSource], T]) -> T:
        with self._opened() as source:
            return read(source)

    @contextmanager
    def _opened(self) -> Iterator[DeclaredSource]:
        with self._engine.connect() as conn:
            source = open_foreign_source(read_only(conn), self._source, self._kinds,
                                         lock=False)
            try:
                yield source
            finally:
                conn.rollback()

    def _details(self, source: DeclaredSource, rows: list[sa.Row[Any]]) -> list[JobDetail]:
        """Listed rows as jobs' details, read with what a pass reads of them: the step
        ledger, the audit's and the operators' newest moves and the holds, in one read
        of each for all the rows."""
        conn = source.connection
        keys = [str(row.job_id) for row in rows]
        held = held_among(conn, self._name, keys)
        steps, _ = PassLedger(conn, self._name).facts(keys)
        decided = AuditHistory(conn, self._name).last_moves(keys)
        acted = last_moves(conn, self._name, keys)
        words = source.status_words()
        return [self._detail(row, words, held, steps.get(key), (decided.get(key),
                                                                  acted.get(key)))
                for row, key in zip(rows, keys, strict=True)]

    def _detail(self, row: sa.Row[Any], words: Mapping[str, JobStatus], held: set[str],
                steps: StepFacts | None, moves: tuple[LastMove | None, ...]) -> JobDetail:
        raw = None if row.source_status is None else str(row.source_status)
        word = words.get(raw or "")
        status = word.value if word is not None else (raw or "unknown")
        kind = "" if row.job_kind is None else str(row.job_kind)
        plan, states = _plan_and_states(row, steps)
        reading = read_job(
            status, system_reason=row.reason if row.reason in _REASONS else None,
            system_budget=None if row.max_attempts is None else int(row.max_attempts),
            kind_budget=self._kinds.resolve(kind).max_attempts,
            budget_pattern=self._kinds.set_by(kind)["max_attempts"], plan=plan or None,
            states=states, system_resume_step=_number(row._mapping.get("resume_step")),
            system_updated=row.updated_at, system_finished=row.finished_at,
            moves=moves)
        return JobDetail(
            job_id=row.job_id, job_kind=kind, job_status=status, status_reason=reading.reason,
            attempt_count=None if row.attempts is None else int(row.attempts),
            max_attempts=reading.max_attempts, max_attempts_from=reading.max_attempts_from,
            resume_step_index=reading.resume_step_index, plan=plan or None,
            operator_hold=str(row.job_id) in held, last_error_code=None,
            created_at=aware(row.created_at), updated_at=reading.updated_at,
            finished_at=reading.finished_at, step_states=states, source_status=raw)


def _plan_and_states(row: sa.Row[Any], steps: StepFacts | None
                     ) -> tuple[tuple[PlanStep, ...] | None, dict[int, str]]:
    """The job's plan and its steps' states as a pass reads them: the system's own where
    it keeps them (``own_plan``, a mapped table's plan column: an unreadable plan is
    None, its results still listed), else the step ledger's."""
    values = row._mapping
    if "own_plan" in values:
        results = step_results(values["own_steps"]) or ()
        return parse_plan(values["own_plan"]), {i: str(s) for i, s, _ in results}
    if steps is None:
        return None, {}
    return steps.plan, {i: str(s) for i, s, _ in steps.step_rows}


def _number(value: Any) -> int | None:
    return None if value is None else int(value)
