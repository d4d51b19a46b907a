"""The step ledger's store: fenced runs of a foreign job's steps in ``step_ledger_entries``.

The public face is ``reconciler.ledger``, which says how a task uses it; a pass reads and
fences the ledger through ``PassLedger``. Every statement on the ledger is in this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from models import StepLedgerEntry
from reconciler.core.evidence import PlanStep, StepFacts
from reconciler.core.vocabulary import EffectKind, StepState
from reconciler.errors import EffectInDoubt, LeaseLost
from reconciler.storage.clock import db_now, now_plus, seconds_since
from reconciler.storage.engines import DatabaseTimeouts, create_engine, is_postgresql
from reconciler.storage.schema import require_current
from reconciler.storage.sql import key_in, unnest, upsert

Step = PlanStep
"""One step of a run's plan: ``Step("fetch", "idempotent")``."""

JobKey = int | str

__all__ = ["EffectInDoubt", "LeaseLost", "LedgerRun", "Step", "StepLedger"]

ENTRIES: sa.Table = cast(sa.Table, StepLedgerEntry.__table__)
SILENT_CHUNK = 5_000
"""Keys a ``silent_among`` statement binds at most (SQLite binds 32,766 at most)."""
_WRITTEN_BEFORE = (
    sa.select(sa.literal(1)).select_from(ENTRIES)
    .where(ENTRIES.c.source_name == sa.bindparam("source_name"),
           ENTRIES.c.updated_at < now_plus(sa.bindparam("seconds_back", type_=sa.Float())))
    .limit(1))
"""``written_before``'s read, built once: every pass of a foreign source asks it, and
building it again and computing its cache key each time cost more than its execution."""


def job_key_text(job_id: JobKey) -> str:
    """The ledger's spelling of a job id: the decimal text of an integer, else the text."""
    if isinstance(job_id, bool) or not isinstance(job_id, int | str) or job_id == "":
        raise ValueError(f"a job id is an integer or a non-empty string, not {job_id!r}")
    return str(job_id)


class StepLedger:
    """Opens fenced runs; one engine on the reconciler's database."""

    __slots__ = ("_engine", "_owns_engine")

    def __init__(self, database: str | Engine, *,
                 timeouts: DatabaseTimeouts | None = None) -> None:
        if isinstance(database, Engine):
            self._engine, self._owns_engine = database, False
        else:
            self._engine, self._owns_engine = create_engine(database, timeouts=timeouts), True
        require_current(self._engine)

    def run(self, source_name: str, job_id: JobKey, attempt: int,
            steps: Sequence[PlanStep]) -> LedgerRun:
        """Open the run of ``attempt`` of a job: its plan recorded, every earlier run fenced
        (this run takes the job's next run number).

        Raises ``EffectInDoubt`` when an effectful step an earlier run started never
        finished and no decision released it (the job system ran the job again by itself),
        ``LeaseLost`` when a later attempt of the job has opened its run already (or the
        reconciler ended this one), and ``ValueError`` when the plan contradicts the one
        recorded for the job by an earlier attempt.
        """
        key = job_key_text(job_id)
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
            raise ValueError(f"attempt is the job system's attempt counter, not {attempt!r}")
        plan = tuple(steps)
        if not plan or not all(isinstance(s, PlanStep) for s in plan):
            raise ValueError("a run needs a plan of at least one Step")
        if not source_name or len(source_name) > 32:
            raise ValueError(f"source_name must be 1 to 32 characters, not {source_name!r}")
        where = (ENTRIES.c.source_name == source_name, ENTRIES.c.job_key == key)
        with self._engine.begin() as conn:
            # Move the job's ledger to this attempt; an earlier run's writes now match nothing.
            conn.execute(ENTRIES.update().where(*where, ENTRIES.c.attempt_number < attempt)
                         .values(attempt_number=attempt, updated_at=db_now()))
            rows = {r.step_index: r for r in conn.execute(
                sa.select(ENTRIES.c.step_index, ENTRIES.c.step_name, ENTRIES.c.effect_kind,
                          ENTRIES.c.step_state, ENTRIES.c.attempt_number).where(*where))}
            if any(r.attempt_number > attempt for r in rows.values()):
                conn.rollback()
                raise LeaseLost(job_id)
            for index, row in rows.items():
                if index >= len(plan) or (row.step_name, row.effect_kind) != (
                        plan[index].step_name, plan[index].effect_kind):
                    conn.rollback()
                    raise ValueError(f"job {key}: the plan differs from the one an earlier "
                                     f"attempt recorded at step {index}")
            in_doubt = _effect_in_doubt(rows)
            if in_doubt is not None:
                conn.rollback()
                raise EffectInDoubt(job_id, in_doubt, plan[in_doubt].step_name)
            missing = [{"source_name": source_name, "job_key": key, "step_index": i,
                        "step_name": s.step_name, "effect_kind": s.effect_kind,
                        "attempt_number": attempt} for i, s in enumerate(plan) if i not in rows]
            if missing:
                conn.execute(_insert_missing(conn).values(updated_at=db_now()), missing)
            # The next run number, taken under the rows' locks (a run opening at the same
            # time takes the one after): every earlier run's writes now match nothing.
            conn.execute(ENTRIES.update().where(*where)
                         .values(run_number=ENTRIES.c.run_number + 1))
            run_number = int(conn.execute(sa.select(sa.func.max(ENTRIES.c.run_number))
                                          .where(*where)).scalar_one())
        done = {i for i, r in rows.items() if r.step_state == StepState.SUCCEEDED.value}
        pending = tuple(i for i in range(len(plan)) if i not in done)
        return LedgerRun(self._engine, source_name, job_id, attempt, steps=plan,
                         pending=pending, run_number=run_number)

    def close(self) -> None:
        """Dispose of the engine this ledger created (not of one it was given)."""
        if self._owns_engine:
            self._engine.dispose()

    def __enter__(self) -> StepLedger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _insert_missing(conn: Connection) -> Any:
    return upsert(conn.dialect.name, ENTRIES, {})


def _effect_in_doubt(rows: dict[int, Any]) -> int | None:
    """The first effectful step an earlier run started and never finished (None: none).
    A decision that lets it run again (an operator's retry) marks it failed retryably
    first; a pass never resumes at one."""
    for index in sorted(rows):
        row = rows[index]
        if (row.step_state == StepState.STARTED.value
                and row.effect_kind == EffectKind.EFFECTFUL.value):
            return index
    return None


class LedgerRun:
    """One run of one job: which steps are left, and step records fenced on the run's
    number (``run_number``: every later run, and every decision on the job, moves it on)."""

    __slots__ = ("_engine", "_pending", "attempt", "job_id", "run_number", "source_name",
                 "steps")

    def __init__(self, engine: Engine, source_name: str, job_id: JobKey, attempt: int, *,
                 steps: tuple[PlanStep, ...], pending: tuple[int, ...],
                 run_number: int) -> None:
        self._engine = engine
        self.source_name = source_name
        self.job_id = job_id
        self.attempt = attempt
        self.run_number = run_number
        self.steps = steps
        self._pending = pending

    def pending(self) -> list[int]:
        """The indexes of the steps not yet succeeded when the run opened, in order."""
        return list(self._pending)

    @contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Record step ``index`` started, then succeeded; failed if the body raises.

        A failure is recorded as retryable: the job system decides whether to run the job
        again. ``LeaseLost`` when the job was reclaimed: nothing is recorded then.
        """
        if not 0 <= index < len(self.steps):
            raise ValueError(f"step {index} is not in this run's plan of {len(self.steps)}")
        # A started effectful step is never started again (its effect may have happened);
        # a pure or idempotent one is, where a resume hands it back.
        again = (() if self.steps[index].kind is EffectKind.EFFECTFUL
                 else (StepState.STARTED.value,))
        self._write(index, StepState.STARTED, finished=False,
                    allowed=(None, *again, StepState.FAILED.value))
        try:
            yield
        except GeneratorExit:
            # Closed without ever ending (abandoned, not failed): the step stays started.
            raise
        except BaseException:
            self._write(index, StepState.FAILED, finished=True, retryable=True,
                        allowed=(StepState.STARTED.value,))
            raise
        self._write(index, StepState.SUCCEEDED, finished=True,
                    allowed=(StepState.STARTED.value,))

    def _write(self, index: int, state: StepState, *, finished: bool,
               allowed: tuple[str | None, ...], retryable: bool | None = None) -> None:
        key = job_key_text(self.job_id)
        states = [s for s in allowed if s is not None]
        in_state: sa.ColumnElement[bool] = ENTRIES.c.step_state.in_(states)
        if None in allowed:
            in_state = sa.or_(in_state, ENTRIES.c.step_state.is_(None))
        values: dict[str, Any] = {"step_state": state.value, "updated_at": db_now(),
                                  "failure_retryable": retryable}
        if finished:
            values["finished_at"] = db_now()
        else:
            values.update(started_at=db_now(), finished_at=None)
        with self._engine.begin() as conn:
            written = conn.execute(ENTRIES.update().where(
                ENTRIES.c.source_name == self.source_name, ENTRIES.c.job_key == key,
                ENTRIES.c.step_index == index, ENTRIES.c.run_number == self.run_number,
                in_state).values(**values))
            if written.rowcount == 1:
                return
            current = conn.execute(sa.select(ENTRIES.c.run_number, ENTRIES.c.step_state)
                                   .where(ENTRIES.c.source_name == self.source_name,
                                          ENTRIES.c.job_key == key,
                                          ENTRIES.c.step_index == index)).first()
        if current is None or current.run_number != self.run_number:
            raise LeaseLost(self.job_id)
        raise ValueError(f"job {key}: step {index} is {current.step_state or 'not started'}; "
                         f"it cannot become {state.value}")


class PassLedger:
    """The step ledger as one pass's transaction reads and fences it, for one source's
    jobs: the evidence a decision reads (one indexed read per batch), the last write a
    swap repeats, and the fences that move each changed job's ledger past its attempt.

    Made per transaction: the fences a batch's swaps ask for are kept here until
    ``fence_pending`` writes them in one statement.
    """

    __slots__ = ("_conn", "_pending", "_source")

    def __init__(self, conn: Connection, source_name: str) -> None:
        self._conn = conn
        self._source = source_name
        self._pending: list[tuple[str, int]] = []

    def facts(self, keys: Iterable[JobKey]) -> tuple[dict[str, StepFacts], dict[str, Any]]:
        """The records of these jobs, and each one's newest write, by job key text, in one
        read; jobs without any are absent from both."""
        texts = sorted({str(k) for k in keys})
        if not texts:
            return {}, {}
        rows = self._conn.execute(
            sa.select(ENTRIES.c.job_key, ENTRIES.c.step_index, ENTRIES.c.step_name,
                      ENTRIES.c.effect_kind, ENTRIES.c.step_state, ENTRIES.c.failure_retryable,
                      seconds_since(ENTRIES.c.updated_at).label("age"), ENTRIES.c.updated_at)
            .where(ENTRIES.c.source_name == self._source,
                   key_in(self._conn, ENTRIES.c.job_key, texts))
            .order_by(ENTRIES.c.job_key, ENTRIES.c.step_index)
        ).all()
        grouped: dict[str, list[Any]] = {}
        newest: dict[str, Any] = {}
        for row in rows:
            grouped.setdefault(row.job_key, []).append(row)
            newest[row.job_key] = max(newest.get(row.job_key, row.updated_at), row.updated_at)
        facts: dict[str, StepFacts] = {}
        for key, found in grouped.items():
            try:
                plan = tuple(PlanStep(r.step_name, r.effect_kind) for r in found)
            except ValueError:
                continue  # pragma: no cover - the table's checks keep effect kinds known
            ages = [float(r.age) for r in found if r.age is not None]
            facts[key] = StepFacts(
                plan,
                tuple((r.step_index, r.step_state, r.failure_retryable)
                      for r in found if r.step_state is not None),
                min(ages) if ages else None,
            )
        return facts, newest

    def last_write(self, key: sa.ColumnElement[Any]) -> sa.ScalarSelect[Any]:
        """The newest write of the job whose key text is ``key``, in SQL (NULL without
        records): a scan's activity and a swap's time predicate for a system that keeps
        none of its own."""
        return (sa.select(sa.func.max(ENTRIES.c.updated_at))
                .where(ENTRIES.c.source_name == self._source, ENTRIES.c.job_key == key)
                .scalar_subquery())

    def newest_attempt(self, key: sa.ColumnElement[Any]) -> sa.ScalarSelect[Any]:
        """The newest attempt recorded for the job whose key text is ``key``, in SQL
        (NULL without records): the attempt of a system that counts none."""
        return (sa.select(sa.func.max(ENTRIES.c.attempt_number))
                .where(ENTRIES.c.source_name == self._source, ENTRIES.c.job_key == key)
                .scalar_subquery())

    def written_before(self, seconds: float) -> bool:
        """Whether any of the source's jobs has a write older than ``seconds``: without
        one no job of it can be wedged by its records, and the wedged scan is skipped."""
        return self._conn.execute(_WRITTEN_BEFORE, {
            "source_name": self._source, "seconds_back": -float(seconds)}).first() is not None

    def silent_among(self, keys: Sequence[str], seconds: float) -> set[str]:
        """Those of ``keys`` whose newest write is older than ``seconds`` (a job without
        records is never silent), read in chunks of ``SILENT_CHUNK`` keys."""
        silent: set[str] = set()
        for start in range(0, len(keys), SILENT_CHUNK):
            chunk = keys[start:start + SILENT_CHUNK]
            silent.update(self._conn.execute(
                sa.select(ENTRIES.c.job_key)
                .where(ENTRIES.c.source_name == self._source,
                       key_in(self._conn, ENTRIES.c.job_key, chunk))
                .group_by(ENTRIES.c.job_key)
                .having(sa.func.max(ENTRIES.c.updated_at) < now_plus(-seconds))).scalars())
        return silent

    def newest_writes(self, keys: Sequence[str]) -> dict[str, Any]:
        """The newest write of each job about to change (absent: none), in one read for
        the batch; the rows stay locked (on PostgreSQL) until the pass commits, by when
        the swaps have fenced their attempts out."""
        if not keys:
            return {}
        rows = (sa.select(ENTRIES.c.job_key, ENTRIES.c.updated_at)
                .where(ENTRIES.c.source_name == self._source,
                       key_in(self._conn, ENTRIES.c.job_key, keys)))
        if self._conn.dialect.name != "sqlite":
            rows = rows.with_for_update()
        newest: dict[str, Any] = {}
        for key, updated_at in self._conn.execute(rows):
            newest[key] = max(newest.get(key, updated_at), updated_at)
        return newest

    def fence(self, job_id: JobKey, next_attempt: int) -> None:
        """Move the job's ledger past the run just ended (its run number on, its attempt to
        at least ``next_attempt``), so its late writes record nothing and a run of its
        attempt cannot open again: kept until ``fence_pending``, which writes a pass's
        fences at once."""
        self._pending.append((str(job_id), next_attempt))

    def fence_pending(self) -> None:
        """The fences asked for since the last call, written: one statement over their
        keys on PostgreSQL (``unnest``), one per job on SQLite."""
        fences, self._pending = self._pending, []
        if not fences:
            return
        if not is_postgresql(self._conn):
            attempt = sa.bindparam("attempt", type_=sa.BigInteger())
            self._conn.execute(
                ENTRIES.update()
                .where(ENTRIES.c.source_name == sa.bindparam("source"),
                       ENTRIES.c.job_key == sa.bindparam("key"))
                .values(attempt_number=_at_least(attempt),
                        run_number=ENTRIES.c.run_number + 1),
                [{"source": self._source, "key": key, "attempt": attempt}
                 for key, attempt in fences])
            return
        moved = unnest("moved", [("job_key", sa.String(), [key for key, _ in fences]),
                                 ("attempt", sa.BigInteger(), [a for _, a in fences])])
        self._conn.execute(ENTRIES.update()
                           .where(ENTRIES.c.source_name == self._source,
                                  ENTRIES.c.job_key == moved.c.job_key)
                           .values(attempt_number=_at_least(moved.c.attempt),
                                   run_number=ENTRIES.c.run_number + 1))


def _at_least(attempt: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """The job's attempt moved forward to ``attempt``, never back."""
    return sa.case((ENTRIES.c.attempt_number < attempt, attempt),
                   else_=ENTRIES.c.attempt_number)


def restart_attempts(conn: Connection, source_name: str, job_ids: Sequence[JobKey]) -> None:
    """An operator's retry restarted these jobs' attempt counts in their system: their
    ledger counts attempts from 0 again (so the next run, whatever attempt it carries,
    opens) but moves its run number on (so no run of the ended attempts writes again), and
    each step an ended run started and never finished is released as failed retryably (the
    operator decided it may run again); succeeded steps are kept, so each run resumes after
    them. Two statements, however many jobs."""
    if not job_ids:
        return
    where = (ENTRIES.c.source_name == source_name,
             key_in(conn, ENTRIES.c.job_key, [job_key_text(k) for k in job_ids]))
    conn.execute(ENTRIES.update().where(*where, ENTRIES.c.step_state == StepState.STARTED.value)
                 .values(step_state=StepState.FAILED.value, failure_retryable=True,
                         finished_at=db_now()))
    conn.execute(ENTRIES.update().where(*where)
                 .values(attempt_number=0, run_number=ENTRIES.c.run_number + 1,
                         updated_at=db_now()))

