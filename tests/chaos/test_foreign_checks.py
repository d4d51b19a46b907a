"""The foreign chaos checks' excuses for a job left behind, where its system lost it
before any reconciler could see it: Celery's worker accepted it and died before starting
it (an ``accepted`` marker), or no worker ever began it and no decision touched it. Each
is counted lost only once Redis holds no copy of it either (``System.vanished``, read by
the run); anything less is ``jobs_not_terminal``."""

from __future__ import annotations

from tests.chaos.foreign.checks import AuditRow, _how_maybe_lost, _lost_after_acknowledgement
from tests.chaos.foreign.processes import Marker
from tests.chaos.foreign.systems import JobState

JOB = "3cce5d72-efd5-4786-ada5-b5022d7f41e7"
QUEUED = JobState("queued", 2, 4)  # Celery's RETRY row (or no row): the state reads queued
DEAD, ALIVE = 101, 202


def marker(event: str, attempt: int, pid: int, at: float) -> Marker:
    return Marker(JOB, event, attempt, pid, at)


def test_a_resumed_task_acknowledged_by_a_worker_that_died_before_starting_it_is_celerys_loss(
) -> None:
    first_run = [marker("accepted", 1, 7, 1.0), marker("started", 1, 7, 1.1)]
    # The reconciler resumed attempt 1; its re-published message (attempt 2) was taken.
    taken = marker("accepted", 2, DEAD, 9.0)

    assert _lost_after_acknowledgement(QUEUED, [*first_run, taken], {ALIVE})
    assert _lost_after_acknowledgement(None, [marker("accepted", 1, DEAD, 1.0)], {ALIVE})


def test_anything_short_of_that_evidence_is_a_job_left_behind() -> None:
    first_run = [marker("accepted", 1, 7, 1.0), marker("started", 1, 7, 1.1)]

    # A re-publish no worker ever acknowledged: the reconciler's to answer for.
    assert not _lost_after_acknowledgement(QUEUED, first_run, {ALIVE})
    # The worker that acknowledged it still runs: it has not lost it.
    assert not _lost_after_acknowledgement(
        QUEUED, [*first_run, marker("accepted", 2, ALIVE, 9.0)], {ALIVE})
    # It started: a STARTED row was written, the reconciler could see it.
    assert not _lost_after_acknowledgement(
        QUEUED, [*first_run, marker("accepted", 2, DEAD, 9.0), marker("started", 2, DEAD, 9.1)],
        {ALIVE})
    # Left running: a row the reconciler reads.
    assert not _lost_after_acknowledgement(
        JobState("running", 2, 4), [*first_run, marker("accepted", 2, DEAD, 9.0)], {ALIVE})
    # No accepted markers at all (every system but Celery).
    assert not _lost_after_acknowledgement(QUEUED, [marker("started", 1, DEAD, 1.0)], {ALIVE})


def test_a_job_no_worker_began_and_no_decision_touched_may_have_been_lost_in_delivery(
) -> None:
    assert _how_maybe_lost(None, [], [], {ALIVE}) == "in_delivery"
    decided = AuditRow(JOB, 5.0, "resume", "resumed_idempotent_step", 1)
    # The reconciler resumed it: its re-publish is the reconciler's to answer for.
    assert _how_maybe_lost(QUEUED, [], [decided], {ALIVE}) is None
    assert _how_maybe_lost(QUEUED, [marker("started", 1, DEAD, 1.0)], [], {ALIVE}) is None
