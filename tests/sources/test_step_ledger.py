"""The step ledger: a foreign task's steps, recorded and fenced on the attempt (both engines)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import StepLedgerEntry
from reconciler.errors import SchemaOutOfDateError
from reconciler.ledger import LeaseLost, Step, StepLedger

ENTRIES = StepLedgerEntry.__table__
PLAN = [Step("fetch", "idempotent"), Step("charge", "effectful"), Step("notify", "pure")]


@pytest.fixture
def engine(reconciler_engine: Engine) -> Engine:
    """The reconciler's database on each engine."""
    return reconciler_engine


@pytest.fixture
def ledger(engine: Engine) -> Iterator[StepLedger]:
    """A ledger on the migrated database of each engine."""
    with StepLedger(engine) as opened:
        yield opened


def states(engine: Engine, job_key: str, source: str = "procrastinate") -> dict[int, object]:
    """step index -> (state, attempt holding the ledger)."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(ENTRIES.c.step_index, ENTRIES.c.step_state,
                                      ENTRIES.c.attempt_number)
                            .where(ENTRIES.c.source_name == source,
                                   ENTRIES.c.job_key == job_key))
        return {r.step_index: (r.step_state, r.attempt_number) for r in rows}


class TestRecording:
    """A run records its plan and each step's start and end."""

    def test_open_records_the_plan_with_nothing_started(self, ledger: StepLedger,
                                                        engine: Engine) -> None:
        """Opening a run writes one row per step, no state yet; every step is pending."""
        run = ledger.run("procrastinate", 7, 0, PLAN)
        assert run.pending() == [0, 1, 2]
        assert states(engine, "7") == {0: (None, 0), 1: (None, 0), 2: (None, 0)}

    def test_step_is_started_then_succeeded(self, ledger: StepLedger, engine: Engine) -> None:
        """Inside the block the step is started; after it, succeeded."""
        run = ledger.run("procrastinate", 7, 0, PLAN)
        with run.step(0):
            assert states(engine, "7")[0] == ("started", 0)
        assert states(engine, "7")[0] == ("succeeded", 0)

    def test_exception_records_failed_and_propagates(self, ledger: StepLedger,
                                                     engine: Engine) -> None:
        """A step whose body raises is recorded failed; the exception goes on to the task."""
        run = ledger.run("procrastinate", 7, 0, PLAN)
        with pytest.raises(RuntimeError, match="boom"), run.step(0):
            raise RuntimeError("boom")
        assert states(engine, "7")[0] == ("failed", 0)

    def test_next_attempt_skips_succeeded_steps(self, ledger: StepLedger) -> None:
        """A re-run of the job is left only the steps that did not succeed."""
        first = ledger.run("procrastinate", 7, 0, PLAN)
        with first.step(0):
            pass
        second = ledger.run("procrastinate", 7, 1, PLAN)
        assert second.pending() == [1, 2]

    def test_uuid_job_keys_and_sources_are_separate(self, ledger: StepLedger,
                                                    engine: Engine) -> None:
        """pg-boss's UUID ids work; one id under two sources is two jobs."""
        job = str(uuid.uuid4())
        with ledger.run("pg-boss", job, 0, PLAN).step(0):
            pass
        assert ledger.run("table", job, 0, PLAN).pending() == [0, 1, 2]
        assert states(engine, job, "pg-boss")[0] == ("succeeded", 0)

    def test_succeeded_step_cannot_start_again(self, ledger: StepLedger) -> None:
        """Running a finished step again is a programming error, refused."""
        run = ledger.run("procrastinate", 7, 0, PLAN)
        with run.step(0):
            pass
        with pytest.raises(ValueError, match="succeeded"), run.step(0):
            pass


class TestFence:
    """Once a later attempt opened its run, the earlier run records nothing."""

    def test_late_step_start_raises_lease_lost(self, ledger: StepLedger,
                                               engine: Engine) -> None:
        """The reclaimed run's next step start is refused and leaves no trace."""
        old = ledger.run("procrastinate", 7, 0, PLAN)
        ledger.run("procrastinate", 7, 1, PLAN)
        with pytest.raises(LeaseLost), old.step(0):
            pytest.fail("the body of a refused step must not run")
        assert states(engine, "7") == {0: (None, 1), 1: (None, 1), 2: (None, 1)}

    def test_late_step_finish_raises_lease_lost(self, ledger: StepLedger,
                                                engine: Engine) -> None:
        """A step started before the reclaim cannot be recorded succeeded after it."""
        old = ledger.run("procrastinate", 7, 0, PLAN)
        with pytest.raises(LeaseLost), old.step(0):
            ledger.run("procrastinate", 7, 1, PLAN)
        assert states(engine, "7")[0] == ("started", 1)

    def test_late_failure_raises_lease_lost(self, ledger: StepLedger, engine: Engine) -> None:
        """A late failure record is refused too; the task sees LeaseLost."""
        old = ledger.run("procrastinate", 7, 0, PLAN)

        def fails_after_reclaim() -> None:
            with old.step(0):
                ledger.run("procrastinate", 7, 1, PLAN)
                raise RuntimeError("boom")

        with pytest.raises(LeaseLost):
            fails_after_reclaim()
        assert states(engine, "7")[0] == ("started", 1)

    def test_earlier_attempt_cannot_open_after_a_later_one(self, ledger: StepLedger,
                                                           engine: Engine) -> None:
        """Opening a run of an older attempt is refused and moves nothing back."""
        ledger.run("procrastinate", 7, 3, PLAN)
        with pytest.raises(LeaseLost):
            ledger.run("procrastinate", 7, 2, PLAN)
        assert {attempt for _, attempt in states(engine, "7").values()} == {3}

    def test_same_attempt_may_reopen(self, ledger: StepLedger) -> None:
        """A task that opens its run twice in one attempt keeps going."""
        ledger.run("procrastinate", 7, 1, PLAN)
        with ledger.run("procrastinate", 7, 1, PLAN).step(0):
            pass


class TestRefusals:
    """Misuse is refused in one line before anything is written."""

    def test_plan_that_contradicts_the_recorded_one(self, ledger: StepLedger,
                                                    engine: Engine) -> None:
        """A different step at a recorded index is a ValueError; nothing moves."""
        ledger.run("procrastinate", 7, 0, PLAN)
        with pytest.raises(ValueError, match="plan differs"):
            ledger.run("procrastinate", 7, 1, [Step("fetch", "effectful"), *PLAN[1:]])
        assert {attempt for _, attempt in states(engine, "7").values()} == {0}

    @pytest.mark.parametrize(("job_id", "attempt", "steps"), [
        (True, 0, PLAN), ("", 0, PLAN), (7, -1, PLAN), (7, "1", PLAN), (7, 0, []),
    ])
    def test_bad_arguments(self, ledger: StepLedger, job_id: object, attempt: object,
                           steps: list[Step]) -> None:
        """Bad ids, attempts and plans are ValueErrors."""
        with pytest.raises(ValueError):  # noqa: PT011 - each case words its own message
            ledger.run("procrastinate", job_id, attempt, steps)  # type: ignore[arg-type]

    def test_step_outside_the_plan(self, ledger: StepLedger) -> None:
        """A step index the plan does not have is refused."""
        with pytest.raises(ValueError, match="not in this run"), \
                ledger.run("procrastinate", 7, 0, PLAN).step(3):
            pass

    def test_old_schema_is_refused(self, tmp_path: Path) -> None:
        """A ledger on a database without the reconciler's schema says so in one line."""
        with pytest.raises(SchemaOutOfDateError, match="db upgrade"):
            StepLedger(f"sqlite:///{tmp_path / 'empty.db'}")
