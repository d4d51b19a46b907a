"""Operator actions on RQ, with the reconciler's own tables on SQLite and PostgreSQL, real
``rq worker`` processes and a real Redis: a held stale job waits for its unhold; a retried
terminalization is run by a real worker under its own id; a cancelled queued job never
runs; a running job is stopped by its worker (a dead worker's job is written canceled);
an action on a job that moved meanwhile is refused with nothing written. Each result is
read through RQ's own API (``Job.fetch``, its registries)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Connection

from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.vocabulary import Disposition, JobKey, OperatorAction, Reason
from reconciler.sources.rq.actions import RqActions
from reconciler.sources.rq.listing import connect
from tests.sources.actions_support import desk_for, desk_moving_after_read, forget_source
from tests.sources.rq_operator_support import HANG_ONCE, config_file, failed
from tests.sources.rq_support import (
    IDEMPOTENT,
    RqProject,
    rq_project,
    sigkill,
    start_worker,
    wait_started,
    wait_status,
)
from tests.sources.support import Markers, Outcome, Processes, by_job, reconcile_once
from tests.sources.test_operator_commands import cli
from tests.sources.test_rq_workers import KINDS

__all__ = ["rq_project"]  # a fixture, found by name
SOURCE = "rq"



@pytest.fixture
def project(rq_project: RqProject) -> RqProject:
    """The app's Redis and the reconciler's tables, with no record of an earlier test."""
    forget_source(rq_project.engine, SOURCE)
    return rq_project


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def desk_of(project: RqProject) -> OperatorDesk:
    return desk_for(project.engine, project.config(), KINDS)


def decided(project: RqProject, job_id: str) -> Outcome:
    """One real pass's decision about the job."""
    return by_job(reconcile_once(project.engine, project.config(), KINDS))[job_id]


def test_a_held_stale_job_is_left_alone_until_unheld(
        project: RqProject, processes: Processes, markers: Markers) -> None:
    """Held while it runs, its worker then SIGKILLed: a pass skips it ``operator_hold``
    and RQ still reads it started; unheld, the next pass resumes it and a new worker
    finishes it."""
    job_id = project.enqueue(IDEMPOTENT, hang=[3600, 0])
    first = start_worker(processes, project, markers, "worker-a")
    wait_started(markers, job_id, first)
    desk = desk_of(project)
    report = desk.act(OperatorAction.HOLD, job_id, actor="dana", note=None)
    assert report.applied, report.line
    assert "workers are not stopped" in report.line
    sigkill(first)
    project.expire_as_time_would(job_id, first)
    held = decided(project, job_id)
    assert (held.disposition, held.reason) == (Disposition.SKIP, Reason.OPERATOR_HOLD)
    assert project.status(job_id) == "started"
    assert desk.act(OperatorAction.HOLD, job_id, actor="dana", note=None).refusal \
        == "already_held"
    assert desk.act(OperatorAction.UNHOLD, job_id, actor="dana", note=None).applied
    assert decided(project, job_id).disposition is Disposition.RESUME
    second = start_worker(processes, project, markers, "worker-b")
    wait_status(project, job_id, "finished", worker=second)


def test_retry_of_a_terminalized_job_is_run_by_a_real_worker(
        project: RqProject, processes: Processes, markers: Markers) -> None:
    """Failed by a pass (effectful, its worker killed), retried with a note: back on its
    queue as RQ's requeue leaves a job, same id, a fresh count; a new worker runs it and
    RQ reads it finished. A second retry is refused: it is not failed any more."""
    job_id = project.enqueue(HANG_ONCE, retry=2)
    first = start_worker(processes, project, markers, "worker-a")
    wait_started(markers, job_id, first)
    sigkill(first)
    project.expire_as_time_would(job_id, first)
    assert decided(project, job_id).reason is Reason.WORKER_DIED_MID_STEP
    queue = project.queue()
    assert job_id in queue.failed_job_registry.get_job_ids()
    desk = desk_of(project)
    report = desk.act(OperatorAction.RETRY, job_id, actor="alice", note="not charged")
    assert report.applied, report.line
    assert "failed -> queued" in report.line
    job = project.job(job_id)
    assert (job.get_status().value, job.retries_left) == ("queued", 2)
    assert job_id not in queue.failed_job_registry.get_job_ids()
    assert queue.job_ids == [job_id]
    second = start_worker(processes, project, markers, "worker-b")
    wait_status(project, job_id, "finished", worker=second)
    # The attempt count started again: the new run is attempt 1 of a fresh budget.
    assert project.job(job_id).return_value() == "done on attempt 1"
    assert desk.act(OperatorAction.RETRY, job_id, actor="alice", note="twice").refusal \
        == "job_not_failed_or_cancelled"


def test_cancel_of_a_queued_job_is_rqs_cancel_and_it_never_runs(
        project: RqProject, processes: Processes, markers: Markers) -> None:
    """Cancelled while queued: RQ reads it canceled, in its canceled registry and off the
    queue; a worker started afterwards runs the next job and never this one."""
    job_id = project.enqueue(IDEMPOTENT, hang=[0])
    report = desk_of(project).act(OperatorAction.CANCEL, job_id, actor="bob",
                                  note="customer asked")
    assert report.applied, report.line
    assert "queued -> canceled" in report.line
    queue = project.queue()
    assert project.status(job_id) == "canceled"
    assert job_id in queue.canceled_job_registry.get_job_ids()
    assert queue.job_ids == []
    worker = start_worker(processes, project, markers, "worker-a")
    later = project.enqueue(IDEMPOTENT, hang=[0])
    wait_status(project, later, "finished", worker=worker)
    assert markers.of(job_id) == set()
    assert desk_of(project).act(OperatorAction.CANCEL, job_id, actor="bob",
                                note="again").refusal == "job_terminal"


def test_cancel_of_a_running_job_is_stopped_by_its_worker(
        project: RqProject, processes: Processes, markers: Markers) -> None:
    """Cancelled while a live worker runs it: RQ's stop-job command reaches the worker,
    which kills its work horse and ends the job stopped in the failed registry; the
    worker lives on and runs the next job; the stopped job is never finished."""
    job_id = project.enqueue(IDEMPOTENT, hang=[3600])
    worker = start_worker(processes, project, markers, "worker-a")
    wait_started(markers, job_id, worker)
    report = desk_of(project).act(OperatorAction.CANCEL, job_id, actor="bob", note="stop")
    assert report.applied, report.line
    assert "started -> stopped" in report.line
    assert project.status(job_id) == "stopped"
    assert job_id in project.queue().failed_job_registry.get_job_ids()
    later = project.enqueue(IDEMPOTENT, hang=[0])
    wait_status(project, later, "finished", worker=worker)
    assert markers.of(job_id) == {"started-1"}


def test_cancel_of_a_dead_workers_job_writes_rqs_canceled_shape(
        project: RqProject, processes: Processes, markers: Markers) -> None:
    """Its worker SIGKILLed, nobody hears the stop-job command: the job is written
    canceled, out of the started registry and its execution record; no pass decides it
    afterwards and a new worker never runs it."""
    job_id = project.enqueue(IDEMPOTENT, hang=[3600, 0])
    first = start_worker(processes, project, markers, "worker-a")
    wait_started(markers, job_id, first)
    sigkill(first)
    report = desk_of(project).act(OperatorAction.CANCEL, job_id, actor="bob", note="gone")
    assert report.applied, report.line
    assert "started -> canceled" in report.line
    assert project.status(job_id) == "canceled"
    assert project.entry_score(job_id) is None
    assert project.redis().zcard(f"rq:executions:{job_id}") == 0
    assert job_id in project.queue().canceled_job_registry.get_job_ids()
    assert job_id not in {o.job_id for o in reconcile_once(project.engine, project.config(),
                                                           KINDS)}
    second = start_worker(processes, project, markers, "worker-b")
    later = project.enqueue(IDEMPOTENT, hang=[0])
    wait_status(project, later, "finished", worker=second)
    assert markers.of(job_id) == {"started-1"}


def _requeued_by_rq(project: RqProject) -> Any:
    def move(conn: Connection, key: JobKey) -> None:
        project.queue().failed_job_registry.requeue(str(key))
    return move


def _canceled_by_rq(project: RqProject) -> Any:
    def move(conn: Connection, key: JobKey) -> None:
        project.job(str(key)).cancel()
    return move


def _taken_by_a_worker(project: RqProject) -> Any:
    def move(conn: Connection, key: JobKey) -> None:
        from rq import Queue  # noqa: PLC0415

        # A worker's dequeue (RQ's own): the id leaves the queue's list before the
        # worker writes anything in the job's hash.
        assert Queue.dequeue_any([project.queue()], None, connection=project.redis())
    return move


@pytest.mark.parametrize(("action", "moved_by", "after", "on_queue"), [
    (OperatorAction.RETRY, _requeued_by_rq, "queued", True),
    (OperatorAction.CANCEL, _canceled_by_rq, "canceled", False),
    (OperatorAction.CANCEL, _taken_by_a_worker, "queued", False),
])
def test_an_action_on_a_job_that_moved_meanwhile_is_refused(
        project: RqProject, action: OperatorAction, moved_by: Any, after: str,
        on_queue: bool) -> None:
    """RQ's own requeue, cancel or a worker's dequeue lands between the action's read and
    its write: the action is refused ``fence_lost``, recorded so, and writes nothing (the
    job is once on its queue, canceled as RQ wrote it, or with the worker that took it)."""
    job_id = project.enqueue(IDEMPOTENT, hang=[0])
    if action is OperatorAction.RETRY:
        failed(project, job_id)

    def actions(conn: Connection, config: Any, kinds: Any) -> RqActions:
        return RqActions(connect(config.url), config)

    desk = desk_moving_after_read(project.engine, SOURCE, project.config(), KINDS,
                                  actions=actions, move=moved_by(project))
    report = desk.act(action, job_id, actor="erin", note="n")
    assert (report.applied, report.refusal) == (False, "fence_lost")
    assert project.status(job_id) == after
    assert project.queue().job_ids == ([job_id] if on_queue else [])
    assert job_id not in project.queue().canceled_job_registry.get_job_ids() \
        or after == "canceled"


def test_bulk_retry_by_reason_requeues_each_terminalized_job(
        project: RqProject, processes: Processes, markers: Markers, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Two jobs failed ``worker_died_mid_step`` by one pass: ``jobs retry --reason
    worker_died_mid_step --yes`` requeues both, each fenced and recorded on its own, and
    one new worker finishes both."""
    jobs = [project.enqueue(HANG_ONCE) for _ in range(2)]
    doomed = [start_worker(processes, project, markers, f"doomed-{i}") for i in range(2)]
    for job_id in jobs:
        wait_started(markers, job_id, doomed[0])
    for worker in doomed:
        sigkill(worker)
    for job_id in jobs:
        project.expire_as_time_would(job_id, doomed[0])
    project.redis().delete(f"rq:worker:{doomed[1].name}")
    assert {o.job_id: o.reason for o in reconcile_once(project.engine, project.config(),
                                                        KINDS)} == {
        job_id: Reason.WORKER_DIED_MID_STEP for job_id in jobs}
    path = config_file(tmp_path, project)
    code, out, err = cli(capsys, path, "jobs", "retry", "--reason", "worker_died_mid_step",
                         "--note", "refunds checked", "--yes")
    assert code == 0, err
    assert "retry: applied 2, refused 0" in out
    assert {project.status(job_id) for job_id in jobs} == {"queued"}
    worker = start_worker(processes, project, markers, "worker-new")
    for job_id in jobs:
        wait_status(project, job_id, "finished", worker=worker)
