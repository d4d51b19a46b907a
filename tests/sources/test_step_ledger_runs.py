"""The step ledger's runs (both engines): each run of a job fenced on a number of the
ledger's own, and a started effectful step never handed to a run no decision allowed.

A job system may run a job again by itself (RQ's cleanup requeues it under the same
attempt count, pg-boss's expiry retries it, kombu redelivers it): the ledger refuses that
run its started effectful step, whatever attempt it says it is; and no run that was ended
(by a later run, a pass or an operator's retry) writes again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import StepLedgerEntry
from reconciler.ledger import EffectInDoubt, LeaseLost, LedgerRun, Step, StepLedger
from reconciler.storage.step_ledger import PassLedger, restart_attempts

ENTRIES = StepLedgerEntry.__table__
PLAN = [Step("fetch", "idempotent"), Step("charge", "effectful"), Step("notify", "pure")]
SOURCE = "rq"


@pytest.fixture
def ledger(reconciler_engine: Engine) -> Iterator[StepLedger]:
    with StepLedger(reconciler_engine) as opened:
        yield opened


def rows(engine: Engine, job: str) -> dict[int, tuple[object, ...]]:
    """step index -> (state, attempt, run number)."""
    with engine.connect() as conn:
        found = conn.execute(sa.select(ENTRIES.c.step_index, ENTRIES.c.step_state,
                                       ENTRIES.c.attempt_number, ENTRIES.c.run_number)
                             .where(ENTRIES.c.source_name == SOURCE,
                                    ENTRIES.c.job_key == job))
        return {r.step_index: (r.step_state, r.attempt_number, r.run_number) for r in found}


def died_in_charge(ledger: StepLedger, job: str, attempt: int = 1) -> LedgerRun:
    """A run that finished ``fetch``, started ``charge`` and never ended it (its worker
    was SIGKILLed inside the effect); the run, as its paused worker would still hold it."""
    run = ledger.run(SOURCE, job, attempt, PLAN)
    with run.step(0):
        pass
    run.step(1).__enter__()  # started; the block never ends
    return run


def pass_fenced(engine: Engine, job: str, next_attempt: int) -> None:
    """What a pass's resume or terminalization writes to the ledger."""
    with engine.begin() as conn:
        fences = PassLedger(conn, SOURCE)
        fences.fence(job, next_attempt)
        fences.fence_pending()


def operator_retried(engine: Engine, job: str) -> None:
    """What an operator's retry writes to the ledger (the desk's ``restart_attempts``)."""
    with engine.begin() as conn:
        restart_attempts(conn, SOURCE, [job])


class TestEffectInDoubt:
    """A run the job system started by itself never gets a started effectful step."""

    @pytest.mark.parametrize("attempt", [1, 2], ids=["same-count", "count-advanced"])
    def test_a_run_no_decision_allowed_is_refused_naming_the_step(
            self, ledger: StepLedger, reconciler_engine: Engine, attempt: int) -> None:
        """RQ's own requeue runs the job under the same count (the documented recipe reads
        ``reconciler_attempt or 1``); pg-boss's expiry under the next: both refused, and
        nothing of the job's ledger changes."""
        died_in_charge(ledger, "job-1")
        before = rows(reconciler_engine, "job-1")
        with pytest.raises(EffectInDoubt, match=r"step 1 \('charge', effectful\)") as raised:
            ledger.run(SOURCE, "job-1", attempt, PLAN)
        assert (raised.value.step_index, raised.value.step_name) == (1, "charge")
        assert isinstance(raised.value, LeaseLost)
        assert rows(reconciler_engine, "job-1") == before

    def test_a_started_idempotent_step_is_handed_back(self, ledger: StepLedger) -> None:
        """Running it again is safe: the next run gets it, and may start it again."""
        run = ledger.run(SOURCE, "job-2", 1, PLAN)
        run.step(0).__enter__()
        again = ledger.run(SOURCE, "job-2", 1, PLAN)
        assert again.pending() == [0, 1, 2]
        with again.step(0):
            pass

    def test_an_operators_retry_lets_the_step_run_again(
            self, ledger: StepLedger, reconciler_engine: Engine) -> None:
        """After the pass ended the job and an operator who checked the effect retried it,
        the next run (the system counting from 1 again) gets the step, recorded as failed
        retryably by the retry."""
        died_in_charge(ledger, "job-3")
        pass_fenced(reconciler_engine, "job-3", 2)
        operator_retried(reconciler_engine, "job-3")
        assert rows(reconciler_engine, "job-3")[1][0] == "failed"
        run = ledger.run(SOURCE, "job-3", 1, PLAN)
        assert run.pending() == [1, 2]
        with run.step(1):
            pass
        assert rows(reconciler_engine, "job-3")[1][0] == "succeeded"

    def test_an_effectful_step_is_not_started_twice_in_one_run(
            self, ledger: StepLedger) -> None:
        """The same run entering a started effectful step again is refused."""
        run = ledger.run(SOURCE, "job-4", 1, PLAN)
        run.step(1).__enter__()
        with pytest.raises(ValueError, match="started"), run.step(1):
            pytest.fail("the body of a refused step must not run")


class TestRunFence:
    """The fence is the run, and it only moves forward."""

    def test_a_reopened_run_of_the_same_attempt_fences_the_first(
            self, ledger: StepLedger, reconciler_engine: Engine) -> None:
        """Two runs of one attempt (a redelivered message): the first writes nothing more."""
        first = ledger.run(SOURCE, "job-5", 1, PLAN)
        second = ledger.run(SOURCE, "job-5", 1, PLAN)
        assert second.run_number == first.run_number + 1
        with pytest.raises(LeaseLost), first.step(0):
            pytest.fail("the body of a refused step must not run")
        with second.step(0):
            pass

    def test_a_pass_fences_the_run_whatever_attempt_comes_next(
            self, ledger: StepLedger, reconciler_engine: Engine) -> None:
        """After a pass's decision the dead run's late write is refused, and a run of its
        attempt cannot open again."""
        run = ledger.run(SOURCE, "job-6", 1, PLAN)
        pass_fenced(reconciler_engine, "job-6", 2)
        with pytest.raises(LeaseLost), run.step(0):
            pytest.fail("the body of a refused step must not run")
        with pytest.raises(LeaseLost):
            ledger.run(SOURCE, "job-6", 1, PLAN)

    def test_an_operators_retry_never_lets_the_ended_run_write_again(
            self, ledger: StepLedger, reconciler_engine: Engine) -> None:
        """Attempt 1's worker was only paused; the pass ended the job, an operator retried
        it, and the system counts from attempt 1 again: the paused run is still refused
        once the new run of attempt 1 opened, and its write changes nothing."""
        paused = ledger.run(SOURCE, "job-7", 1, PLAN)
        pass_fenced(reconciler_engine, "job-7", 2)
        operator_retried(reconciler_engine, "job-7")
        fresh = ledger.run(SOURCE, "job-7", 1, PLAN)
        with pytest.raises(LeaseLost), paused.step(0):
            pytest.fail("the body of a refused step must not run")
        assert rows(reconciler_engine, "job-7")[0][0] is None
        with fresh.step(0):
            pass

    def test_runs_opened_at_once_get_distinct_numbers_and_only_the_last_writes(
            self, ledger: StepLedger, reconciler_engine: Engine) -> None:
        """Eight threads open the same job's run together (each on its own connection):
        eight distinct run numbers, and only the highest's write is recorded."""
        ledger.run(SOURCE, "job-8", 1, PLAN)
        opened: list[LedgerRun] = []
        barrier = threading.Barrier(8)

        def open_one() -> None:
            barrier.wait()
            opened.append(ledger.run(SOURCE, "job-8", 1, PLAN))

        threads = [threading.Thread(target=open_one) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert len({run.run_number for run in opened}) == 8
        last = max(opened, key=lambda run: run.run_number)
        for run in opened:
            if run is last:
                with run.step(0):
                    pass
            else:
                with pytest.raises(LeaseLost), run.step(0):
                    pytest.fail("the body of a refused step must not run")
