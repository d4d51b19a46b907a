"""The step ledger's store: fenced runs of a foreign job's steps in ``step_ledger_entries``.

The public face is ``reconciler.ledger``, which says how a task uses
it; this module holds its SQL.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from models import StepLedgerEntry
from reconciler.core.evidence import PlanStep
from reconciler.core.vocabulary import StepState
from reconciler.errors import LeaseLost
from reconciler.storage.clock import db_now
from reconciler.storage.engines import DatabaseTimeouts, create_engine, is_postgresql
from reconciler.storage.schema import require_current

Step = PlanStep
"""One step of a run's plan: ``Step("fetch", "idempotent")``."""

JobKey = int | str

__all__ = ["LeaseLost", "LedgerRun", "Step", "StepLedger"]

ENTRIES: sa.Table = cast(sa.Table, StepLedgerEntry.__table__)


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
        """Open the run of ``attempt`` of a job: its plan recorded, earlier attempts fenced.

        Raises ``LeaseLost`` when a later attempt of the job has opened its run already (or
        the reconciler ended this one), and ``ValueError`` when the plan contradicts the one
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
            missing = [{"source_name": source_name, "job_key": key, "step_index": i,
                        "step_name": s.step_name, "effect_kind": s.effect_kind,
                        "attempt_number": attempt} for i, s in enumerate(plan) if i not in rows]
            if missing:
                conn.execute(_insert_missing(conn).values(updated_at=db_now()), missing)
        done = {i for i, r in rows.items() if r.step_state == StepState.SUCCEEDED.value}
        pending = tuple(i for i in range(len(plan)) if i not in done)
        return LedgerRun(self._engine, source_name, job_id, attempt, steps=plan, pending=pending)

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
    dialect = postgresql if is_postgresql(conn) else sqlite
    return dialect.insert(ENTRIES).on_conflict_do_nothing()


class LedgerRun:
    """One attempt's run of one job: which steps are left, and fenced step records."""

    __slots__ = ("_engine", "_pending", "attempt", "job_id", "source_name", "steps")

    def __init__(self, engine: Engine, source_name: str, job_id: JobKey, attempt: int, *,
                 steps: tuple[PlanStep, ...], pending: tuple[int, ...]) -> None:
        self._engine = engine
        self.source_name = source_name
        self.job_id = job_id
        self.attempt = attempt
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
        self._write(index, StepState.STARTED, finished=False,
                    allowed=(None, StepState.STARTED.value, StepState.FAILED.value))
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
                ENTRIES.c.step_index == index, ENTRIES.c.attempt_number == self.attempt,
                in_state).values(**values))
            if written.rowcount == 1:
                return
            current = conn.execute(sa.select(ENTRIES.c.attempt_number, ENTRIES.c.step_state)
                                   .where(ENTRIES.c.source_name == self.source_name,
                                          ENTRIES.c.job_key == key,
                                          ENTRIES.c.step_index == index)).first()
        if current is None or current.attempt_number != self.attempt:
            raise LeaseLost(self.job_id)
        raise ValueError(f"job {key}: step {index} is {current.step_state or 'not started'}; "
                         f"it cannot become {state.value}")
