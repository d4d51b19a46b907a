"""Operator actions on Dramatiq messages, with real ``dramatiq`` workers over a real
Redis and the reconciler's own tables on SQLite and PostgreSQL: a dead letter retried is
run again by a worker with a fresh budget; a queued message cancelled is dead-lettered
``operator_cancel`` and never run; a fetched one is refused; a held message whose worker
died is left alone until it is unheld."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.vocabulary import Disposition, OperatorAction, Reason
from tests.sources.actions_support import desk_for, forget_source
from tests.sources.dramatiq_support import (
    DramatiqProject,
    dramatiq_project,
    reconcile_until,
    result_after,
    sigkill,
    start_worker,
    wait_started,
)
from tests.sources.support import Markers, Processes, by_job, reconcile_once, wait_until
from tests.sources.test_dramatiq_workers import KINDS, decided

__all__ = ["dramatiq_project"]


@pytest.fixture
def project(dramatiq_project: DramatiqProject) -> DramatiqProject:
    forget_source(dramatiq_project.engine, "dramatiq")
    return dramatiq_project


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def desk_of(project: DramatiqProject) -> OperatorDesk:
    return desk_for(project.engine, project.config(), KINDS)


def test_a_dead_letter_retried_runs_again_with_a_fresh_budget(
        project: DramatiqProject, processes: Processes, markers: Markers) -> None:
    message = project.send("effect_work", hang=[3600])
    first = start_worker(processes, project, markers, "worker-a")
    wait_started(markers, message.message_id, first)
    sigkill(first)
    reconcile_until(project, KINDS, decided(message.message_id), "the dead letter")
    assert list(project.dead_lettered()) != []
    desk = desk_of(project)
    assert OperatorAction.RETRY in desk.allowed(message.message_id)
    report = desk.act(OperatorAction.RETRY, message.message_id, actor="alice",
                      note="charge checked: not taken")
    assert report.applied, report.line
    assert project.dead_lettered() == {}
    [stored] = project.messages().values()
    assert stored["options"]["retries"] == 0
    assert "reconciler_reason" not in stored["options"]
    # The effect was checked: a new worker runs it again, from its first attempt.
    second = start_worker(processes, project, markers, "worker-b")
    wait_until(lambda: len([n for n in markers.names()
                            if n.startswith(f"run-{message.message_id}-")]) == 2,
               "the retried run to start", process=second)
    assert markers.of(message.message_id) == {"started-1"}


def test_a_queued_message_cancelled_is_dead_lettered_and_never_runs(
        project: DramatiqProject, processes: Processes, markers: Markers) -> None:
    cancelled = project.send("effect_work", hang=[0])
    desk = desk_of(project)
    report = desk.act(OperatorAction.CANCEL, cancelled.message_id, actor="alice",
                      note="not wanted")
    assert report.applied, report.line
    [dead] = project.dead_lettered().values()
    assert dead["options"]["reconciler_reason"] == "operator_cancel"
    after = project.send("idem_work", hang=[0])
    start_worker(processes, project, markers, "worker-a")
    assert result_after(markers, after, 1) == "done on attempt 1"
    assert markers.of(cancelled.message_id) == set()


def test_a_fetched_message_is_not_cancelled(
        project: DramatiqProject, processes: Processes, markers: Markers) -> None:
    message = project.send("effect_work")
    worker = start_worker(processes, project, markers, "worker-a")
    wait_started(markers, message.message_id, worker)
    report = desk_of(project).act(OperatorAction.CANCEL, message.message_id,
                                  actor="alice", note="stop it")
    assert (report.applied, report.refusal) == (False, "dramatiq_fetched")
    assert worker.alive()
    assert project.dead_lettered() == {}


def test_a_held_message_whose_worker_died_waits_for_its_unhold(
        project: DramatiqProject, processes: Processes, markers: Markers) -> None:
    message = project.send("effect_work")
    worker = start_worker(processes, project, markers, "worker-a")
    wait_started(markers, message.message_id, worker)
    desk = desk_of(project)
    assert desk.act(OperatorAction.HOLD, message.message_id, actor="alice",
                    note="looking").applied
    sigkill(worker)
    held = by_job(reconcile_until(
        project, KINDS, lambda found: message.message_id in by_job(found),
        "the held message to be judged"))[message.message_id]
    assert (held.disposition, held.reason) == (Disposition.SKIP, Reason.OPERATOR_HOLD)
    assert desk.act(OperatorAction.UNHOLD, message.message_id, actor="alice",
                    note="done").applied
    outcome = by_job(reconcile_once(project.engine, project.config(), KINDS))[
        message.message_id]
    assert outcome.reason is Reason.WORKER_DIED_MID_STEP
