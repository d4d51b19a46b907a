"""The step ledger from inside a Dramatiq actor (``reconciler.ledger.StepLedger``, source
``dramatiq``, the message's ``message_id`` and ``retries`` + 1), with the reconciler's own
tables on SQLite and PostgreSQL and real ``dramatiq`` workers SIGKILLed mid-message: a
pass resumes the message at the first step that never started, and a new worker runs only
the steps left; one killed inside its effectful step is dead-lettered."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.core.vocabulary import Disposition, Reason
from tests.sources.dramatiq_support import (
    DramatiqProject,
    dramatiq_project,
    reconcile_until,
    result_of,
    sigkill,
    start_worker,
)
from tests.sources.support import Markers, Processes, by_job, wait_until
from tests.sources.test_dramatiq_workers import KINDS, decided

__all__ = ["dramatiq_project"]


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def test_a_pass_resumes_at_the_first_step_that_never_started(
        dramatiq_project: DramatiqProject, processes: Processes, markers: Markers) -> None:
    """Killed after ``fetch`` succeeded, before ``charge`` started: resumed at step 1 (the
    actor is effectful, but no effectful step ever started); the new worker runs
    ``charge`` and ``notify`` only."""
    message = dramatiq_project.send("ledger_charge", hang="between")
    first = start_worker(processes, dramatiq_project, markers, "worker-a")
    wait_until(lambda: markers.has(f"{message.message_id}-between-1"), "fetch to succeed",
               process=first)
    sigkill(first)
    outcome = by_job(reconcile_until(dramatiq_project, KINDS, decided(message.message_id),
                                     "the message to be decided"))[message.message_id]
    assert (outcome.disposition, outcome.reason, outcome.resume_step_index) == (
        Disposition.RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP, 1)
    start_worker(processes, dramatiq_project, markers, "worker-b")
    assert result_of(message) == "done on attempt 2"
    assert markers.of(message.message_id) == {
        "step-fetch-1", "between-1", "step-charge-2", "step-notify-2"}


def test_a_message_killed_inside_its_effectful_step_is_dead_lettered(
        dramatiq_project: DramatiqProject, processes: Processes, markers: Markers) -> None:
    message = dramatiq_project.send("ledger_charge", hang="charge")
    first = start_worker(processes, dramatiq_project, markers, "worker-a")
    wait_until(lambda: markers.has(f"{message.message_id}-step-charge-1"),
               "charge to start", process=first)
    sigkill(first)
    outcome = by_job(reconcile_until(dramatiq_project, KINDS, decided(message.message_id),
                                     "the message to be decided"))[message.message_id]
    assert (outcome.disposition, outcome.reason) == (Disposition.TERMINALIZE,
                                                     Reason.WORKER_DIED_MID_STEP)
    [dead] = dramatiq_project.dead_lettered().values()
    assert dead["options"]["reconciler_reason"] == "worker_died_mid_step"
