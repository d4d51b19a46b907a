"""The read model every view of a job goes through (``reconciler.core.job_story``): which
reason applies now, where the budget comes from, the step a job resumes at, and times
that carry their offsets and only move forward. Pure: every combination is checked."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta, timezone

import pytest

from reconciler.core.evidence import PlanStep
from reconciler.core.job_story import (
    ENDED,
    WILL_RUN,
    LastMove,
    aware,
    budget_from,
    current_reason,
    latest,
    read_job,
    resume_step,
)
from reconciler.core.vocabulary import EffectKind, JobStatus

pytestmark = pytest.mark.fast

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
STATUSES = [s.value for s in JobStatus]
TERMINALIZED = LastMove(T0, "worker_died_mid_step", ended=True)
RESUMED = LastMove(T0, "resumed_idempotent_step", ended=False)
RETRIED = LastMove(T0, "operator_retry", ended=False)
CANCELLED = LastMove(T0, "operator_cancel", ended=True)
PLAN = (PlanStep("a", EffectKind.IDEMPOTENT), PlanStep("b", EffectKind.EFFECTFUL),
        PlanStep("c", EffectKind.PURE))


@pytest.mark.parametrize(("status", "system", "last"), list(itertools.product(
    STATUSES, [None, "step_failed"], [None, TERMINALIZED, RESUMED, RETRIED, CANCELLED])))
def test_the_reason_that_applies_now(status: str, system: str | None,
                                     last: LastMove | None) -> None:
    """The newest move's reason while the job is where it left it: ended for an end,
    queued for a resume or retry; otherwise the system's own, only for an ended job."""
    reason = current_reason(status, system, last)
    where_it_left = last is not None and (
        status in ENDED if last.ended else status == JobStatus.QUEUED.value)
    if where_it_left:
        assert last is not None
        assert reason == last.reason
    elif status in ENDED:
        assert reason == system
    else:
        assert reason is None


def test_a_retry_makes_an_old_terminal_reason_history() -> None:
    """pg-boss keeps its old output after a retry: the retry, not the old reason, is shown;
    once a worker claims the job, neither."""
    assert current_reason("queued", "worker_died_mid_step", RETRIED) == "operator_retry"
    assert current_reason("processing", "worker_died_mid_step", RETRIED) is None
    # The system ended it on its own after the retry: the retry is no reason for that.
    assert current_reason("failed", None, RETRIED) is None


def test_where_the_budget_comes_from() -> None:
    assert budget_from(1, None) == "job"
    assert budget_from(1, "billing.*") == "job"
    assert budget_from(None, "billing.*") == '[kinds."billing.*"]'
    assert budget_from(None, None) == "default"


@pytest.mark.parametrize("status", STATUSES)
def test_only_a_job_that_will_run_resumes_somewhere(status: str) -> None:
    """The first step not succeeded (the system's own record first); none once ended."""
    states = {0: "succeeded", 1: "started"}
    step = resume_step(status, PLAN, states)
    assert step == (1 if status in WILL_RUN else None)
    assert resume_step(status, PLAN, states, own=2) == (2 if status in WILL_RUN else None)
    assert resume_step(status, None, {}) == (0 if status in WILL_RUN else None)
    every = {0: "succeeded", 1: "succeeded", 2: "succeeded"}
    assert resume_step(status, PLAN, every) == (3 if status in WILL_RUN else None)


def test_times_carry_their_offsets_and_only_move_forward() -> None:
    naive = datetime(2026, 12, 1, 12, 0)
    assert aware(naive) == T0
    assert aware(None) is None
    east = datetime(2026, 12, 1, 13, 0, tzinfo=timezone(timedelta(hours=1)))
    assert aware(east) is east
    assert latest(None, naive, T0 + timedelta(seconds=1)) == T0 + timedelta(seconds=1)
    assert latest(None, None) is None


def test_a_reading_after_a_terminalization_and_a_retry() -> None:
    """pg-boss clears ``completed_on`` on a retry: the job's updated time is the retry's,
    not back at its start; it has no finish time while queued, and its budget is its own."""
    started = T0 - timedelta(minutes=5)
    retried = LastMove(T0 + timedelta(minutes=1), "operator_retry", ended=False)
    reading = read_job("queued", system_reason="worker_died_mid_step", system_budget=1,
                       kind_budget=3, budget_pattern=None, plan=PLAN,
                       states={0: "succeeded"}, system_updated=started, system_finished=None,
                       moves=(TERMINALIZED, retried))
    assert (reading.reason, reading.resume_step_index) == ("operator_retry", 1)
    assert (reading.max_attempts, reading.max_attempts_from) == (1, "job")
    assert (reading.updated_at, reading.finished_at) == (retried.at, None)


def test_a_reading_of_a_job_ended_by_the_audit_alone() -> None:
    """An ended job whose system keeps no finish time: the move that ended it stands in,
    and the kind's budget (from the settings) applies."""
    reading = read_job("failed", system_reason=None, system_budget=None, kind_budget=3,
                       budget_pattern=None, plan=None, states={},
                       system_updated=datetime(2026, 12, 1, 11, 0), system_finished=None,
                       moves=(None, TERMINALIZED))
    assert (reading.reason, reading.resume_step_index) == ("worker_died_mid_step", None)
    assert (reading.max_attempts, reading.max_attempts_from) == (3, "default")
    assert (reading.updated_at, reading.finished_at) == (T0, T0)
