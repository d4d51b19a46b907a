"""Operator actions on Celery, on SQLite and PostgreSQL, with real Celery workers over a
real Redis: a retried task is re-published with its own id and the caller's
``AsyncResult`` completes on a new worker; a cancelled one is read ``REVOKED`` by the
caller and never run; a held stale task waits for its unhold; a task that moved meanwhile
is refused."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.vocabulary import Disposition, OperatorAction, Reason
from reconciler.sources.celery.actions import CeleryActions
from tests.sources.actions_support import desk_for, desk_moving_after_read, forget_source
from tests.sources.celery_support import CeleryProject, kill_worker
from tests.sources.support import Markers, Processes, reconcile_once, wait_until
from tests.sources.test_celery_workers import (
    KINDS,
    config,
    markers,
    recover,
    send,
    start_worker,
    surviving_worker,
)

__all__ = ["markers", "surviving_worker"]  # fixtures, found by name
SOURCE = "celery"


@pytest.fixture
def project(celery_project: CeleryProject) -> CeleryProject:
    """The Celery app's broker and results, with no record of an earlier test's tasks."""
    forget_source(celery_project.engine, SOURCE)
    return celery_project


def desk_of(project: CeleryProject) -> OperatorDesk:
    return desk_for(project.engine, config(project), KINDS)


def test_retry_republishes_with_the_same_id_and_the_callers_result_completes(
        project: CeleryProject, processes: Processes, markers: Markers) -> None:
    """Failed by a pass (effectful, its worker killed), retried with a note: RETRY, then
    re-published under its own id with a fresh count; a new worker runs it and the
    caller's own AsyncResult returns."""
    result = send(project, "effect.work", hang=[3])
    first = start_worker(processes, project, markers, "worker-a")
    wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
               process=first)
    kill_worker(first)
    assert recover(project, result.id, first).reason is Reason.WORKER_DIED_MID_STEP
    desk = desk_of(project)
    report = desk.act(OperatorAction.RETRY, result.id, actor="alice", note="not charged")
    assert report.applied, report.line
    assert report.line.endswith("FAILURE -> RETRY")
    start_worker(processes, project, markers, "worker-b")
    assert result.get(timeout=60) == "done on attempt 1"
    assert desk.act(OperatorAction.RETRY, result.id, actor="alice", note="twice").refusal \
        == "job_not_failed_or_cancelled"


def test_cancel_of_a_republished_task_is_revoked_and_never_run(
        project: CeleryProject, processes: Processes, markers: Markers) -> None:
    """Resumed by a pass (RETRY, its message on the queue), then cancelled: REVOKED for
    the caller, its message gone, and a new worker never runs it."""
    result = send(project, "idem.work", hang=[3600, 3600])
    first = start_worker(processes, project, markers, "worker-a")
    wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
               process=first)
    kill_worker(first)
    assert recover(project, result.id, first).disposition is Disposition.RESUME
    assert project.status(result.id) == "RETRY"
    report = desk_of(project).act(OperatorAction.CANCEL, result.id, actor="bob",
                                  note="customer asked")
    assert report.applied, report.line
    assert project.status(result.id) == "REVOKED"
    with pytest.raises(Exception, match="revoked") as raised:
        result.get(timeout=5)
    assert type(raised.value).__name__ == "TaskRevokedError"
    start_worker(processes, project, markers, "worker-b")
    later = send(project, "idem.work", hang=[])
    assert later.get(timeout=30) == "done on attempt 1"
    assert markers.of(result.id) == {"started-1"}
    assert desk_of(project).act(OperatorAction.RETRY, result.id, actor="bob",
                                note="n").refusal == "celery_revoked"


def test_a_held_stale_task_is_left_alone_until_unheld(
        project: CeleryProject, processes: Processes, markers: Markers) -> None:
    """Held: its gone worker's task is skipped ``operator_hold``, STARTED still; unheld,
    the next pass decides it."""
    result = send(project, "idem.work", hang=[3600, 0])
    first = start_worker(processes, project, markers, "worker-a")
    wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
               process=first)
    desk = desk_of(project)
    assert desk.act(OperatorAction.HOLD, result.id, actor="d", note=None).applied
    kill_worker(first)
    held = recover_any(project, result.id, first)
    assert (held.disposition, held.reason) == (Disposition.SKIP, Reason.OPERATOR_HOLD)
    assert project.status(result.id) == "STARTED"
    assert desk.act(OperatorAction.UNHOLD, result.id, actor="d", note=None).applied
    assert recover(project, result.id, first).disposition is Disposition.RESUME


def recover_any(project: CeleryProject, task_id: str, worker: Any) -> Any:
    """Passes until one decides the task, applied or not (a skip)."""
    def decided() -> Any:
        for outcome in reconcile_once(project.engine, config(project), KINDS):
            if outcome.job_id == task_id and outcome.reason is not Reason.WORKER_WEDGED:
                return outcome
        return None

    return wait_until(decided, f"a decision on task {task_id}", timeout=30, process=worker)


def test_an_action_on_a_task_that_moved_meanwhile_is_refused(
        project: CeleryProject, processes: Processes, markers: Markers) -> None:
    """Its worker ended it after the read: ``fence_lost``, nothing revoked or written."""
    result = send(project, "idem.work", hang=[3600])
    first = start_worker(processes, project, markers, "worker-a")
    wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
               process=first)

    desk = desk_moving_after_read(
        project.engine, SOURCE, config(project), KINDS, actions=CeleryActions,
        move=lambda conn, key: conn.execute(sa.text(
            f"UPDATE {project.table} SET status = 'SUCCESS' WHERE task_id = :id"),
            {"id": key}))
    report = desk.act(OperatorAction.CANCEL, result.id, actor="e", note="n")
    assert (report.applied, report.refusal) == (False, "fence_lost")
    assert project.status(result.id) == "SUCCESS"
