"""The ``table`` source's fixture: a home-grown job table mapped column by column (every key
of the example in docs/sources.md), on SQLite, PostgreSQL and MariaDB.

The table is the one tests/sources/test_table_source.py maps: a status, a kind, a reason,
activity and lease times, an owner, attempts and their budget, a generation, the resume
step, and the plan and its step results as JSON. Its "worker API" is the job system's own
SQL, so situations are rows written as such a system writes them, each on a connection of
its own (the worker's), never the pass's.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import sqlalchemy as sa

from reconciler.core.vocabulary import EffectKind, StepState
from reconciler.storage.clock import now_plus
from reconciler.storage.engines import create_engine
from tests.conformance.fixtures import (
    PLAN_LENGTH,
    REBORN_STATES,
    TIMING,
    Capability,
    Interference,
    Outcome,
    RegisteredSource,
    Situation,
    SourceJob,
    State,
)
from tests.conformance.foreign import ForeignFixture, kind_for
from tests.helpers import rows_of
from tests.sources.test_table_source import FULL, jobs_table

OUTCOMES: dict[str, Outcome] = {"processing": "running", "pending": "runnable",
                                "failed": "failed", "done": "completed"}
UNREADABLE_PLAN = [{"step_name": "x", "effect_kind": "nuclear"}]


def _gaps() -> dict[Capability, str]:
    gaps: dict[Capability, str] = {}
    for step in range(PLAN_LENGTH):
        for effect in EffectKind:
            gaps[Situation(State.HELD, step, effect)] = (
                "table has no operator hold: a home-grown table maps no hold column")
            gaps[Situation(State.OWNER_GONE, step, effect)] = (
                "table has no owner liveness: only the lease or max_run_seconds says a "
                "worker is gone")
            gaps[Situation(State.STEP_FAILED_RETRYABLY, step, effect)] = (
                "table step results keep a state, not whether a failure may be retried")
            for state in REBORN_STATES:
                gaps[Situation(state, step, effect)] = (
                    "table has no owner liveness: its owner column is a fence, not evidence")
    return gaps


class TableFixture(ForeignFixture):
    """A mapped home-grown table as a source under test (see ``SourceFixture``)."""

    source_name = "table"
    gaps = _gaps()

    def __init__(self, database_url: str) -> None:
        engine = create_engine(database_url)
        self.worker_engine = create_engine(database_url)
        self.jobs = jobs_table(None)
        self.jobs.metadata.create_all(engine)
        super().__init__(engine, replace(FULL, schema=None))
        self._serial = itertools.count(1)

    def close(self) -> None:
        """Release both engines' connections."""
        self.worker_engine.dispose()
        self.engine.dispose()

    # -- making situations --------------------------------------------------------------------

    def make(self, situation: Situation) -> SourceJob:
        """A claimed row in the situation, as the job system's own worker would leave it."""
        state, n = situation.state, situation.step
        plan: Any = [{"step_name": s.step_name, "effect_kind": s.effect_kind.value}
                     for s in situation.plan]
        results = {str(i): StepState.SUCCEEDED.value for i in range(n)}
        if state in (State.LIVE, State.DIED_MID_STEP, State.WEDGED):
            results[str(n)] = StepState.STARTED.value
        elif state is State.STEP_FAILED:
            results[str(n)] = StepState.FAILED.value
        elif state is State.GATED:
            results[str(n)] = StepState.WAITING.value
        elif state is State.COMPLETION_UNRECORDED:
            results = {str(i): StepState.SUCCEEDED.value for i in range(PLAN_LENGTH)}
        elif state is State.PLAN_UNREADABLE:
            plan = UNREADABLE_PLAN
        elif state is State.EVIDENCE_UNREADABLE:
            results[str(PLAN_LENGTH + 4)] = StepState.SUCCEEDED.value
        if state is State.LIVE:
            lease, idle = TIMING.lease_seconds, 0.0
        elif state is State.RECENTLY_ACTIVE:
            lease, idle = -TIMING.recent_seconds / 2, TIMING.recent_seconds
        elif state is State.WEDGED:
            lease, idle = TIMING.lease_seconds, TIMING.wedged_after_seconds + 60
        else:
            lease, idle = -TIMING.lease_expired_seconds, TIMING.idle_seconds
        row = {"job_type": kind_for(situation.effect, next(self._serial)),
               "status": "processing", "claimed_by": "conformance-worker", "attempts": 1,
               "max_attempts": 1 if state is State.OUT_OF_ATTEMPTS else 3, "generation": 1,
               "resume_step": 0, "step_plan": plan, "step_results": results,
               "lease_until": now_plus(lease), "last_activity_at": now_plus(-idle)}
        with self.worker_engine.begin() as conn:
            key = int(conn.execute(self.jobs.insert().values(row).returning(self.jobs.c.id))
                      .scalar_one())
        return SourceJob(key, 1)

    def _update(self, key: int, **values: Any) -> None:
        with self.worker_engine.begin() as conn:
            conn.execute(self.jobs.update().where(self.jobs.c.id == key).values(**values))

    def interfere(self, job: SourceJob, change: Interference) -> None:
        """The slow worker's late write, or another replica and worker taking the job."""
        key = int(job.key)
        if change is Interference.LATE_HEARTBEAT:
            self._update(key, lease_until=now_plus(TIMING.lease_seconds))
        elif change is Interference.LATE_PROGRESS:
            self._update(key, last_activity_at=now_plus(0))
        elif change is Interference.LATE_COMPLETION:
            self._update(key, status="done")
        elif change is Interference.RECLAIM:
            recovered = self.run_pass()
            assert [d.job_id for d in recovered.decisions] == [key]
            # The job system's next worker claims it (its attempt and generation bumped),
            # then dies too: only the fence tells the slower replica's decision apart.
            row = self._row(key)
            assert row["status"] == "pending"
            self._update(key, status="processing", claimed_by="conformance-second-worker",
                         attempts=row["attempts"] + 1, generation=row["generation"] + 1,
                         lease_until=now_plus(-TIMING.lease_expired_seconds),
                         last_activity_at=now_plus(-TIMING.idle_seconds))
        else:  # pragma: no cover - every member is handled above
            raise AssertionError(change)

    # -- observing ----------------------------------------------------------------------------

    def _row(self, key: int) -> dict[str, Any]:
        [row] = rows_of(self.engine, self.jobs, self.jobs.c.id == key)
        return row

    def status(self, job: SourceJob) -> Outcome:
        """The status column in neutral words."""
        return OUTCOMES[self._row(int(job.key))["status"]]

    def reason(self, job: SourceJob) -> str | None:
        """``status_reason``."""
        reason: str | None = self._row(int(job.key))["status_reason"]
        return reason

    def resume_step(self, job: SourceJob) -> int | None:
        """``resume_step``."""
        step = self._row(int(job.key))["resume_step"]
        return None if step is None else int(step)

    def generation(self, job: SourceJob) -> int | None:
        """``generation``."""
        return int(self._row(int(job.key))["generation"])

    def snapshot(self, job: SourceJob) -> object:
        """The whole row (JSON columns as text, so rows compare with ``==``)."""
        row = self._row(int(job.key))
        return {k: json.dumps(v, sort_keys=True) if isinstance(v, dict | list) else v
                for k, v in row.items()}


@contextmanager
def open_table(database_url: str) -> Iterator[TableFixture]:
    """The table fixture on a migrated database of either engine, closed afterwards."""
    fixture = TableFixture(database_url)
    try:
        yield fixture
    finally:
        fixture.close()


TABLE = RegisteredSource("table", ("sqlite", "postgresql", "mysql"), open_table)

__all__ = ["TABLE", "sa"]
