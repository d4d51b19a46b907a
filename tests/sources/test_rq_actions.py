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
from tests.sources.support import (
    Markers,
    Outcome,
    Processes,
    by_job,
    reconcile_once,
    wait_until,
)
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
    # Redis drops the killed processes' subscription once it sees their sockets closed;
    # a stop-job published before that would still count a listener.
    channel = f"rq:pubsub:{first.name}"
    wait_until(lambda: project.redis().pubsub_numsub(channel) == [(channel.encode(), 0)],
               "the killed worker's subscription to be gone")
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


def _counted_client(url: str) -> tuple[Any, list[int]]:
    """A client of the app's Redis counting its round trips (a pipeline, however long,
    is sent in one write and counts once), connected already so the count starts at 0."""
    import redis  # noqa: PLC0415 - the tests of the rq source have it

    sent: list[int] = []

    class Counted(redis.Connection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            sent.append(1)
            super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]

    client = redis.Redis.from_url(url, connection_class=Counted)
    client.ping()
    sent.clear()
    return client, sent


def _chunk_desk(project: RqProject, client: Any, moves: dict[str, Any]) -> Any:
    """The rq desk over ``client``, each job of ``moves`` moved by its own write between
    the chunk's read and its swap."""
    def actions(conn: Connection, config: Any, kinds: Any) -> RqActions:
        return RqActions(client, config)

    def move(conn: Connection, key: JobKey) -> None:
        if str(key) in moves:
            moves[str(key)](conn, key)

    return desk_moving_after_read(project.engine, SOURCE, project.config(), KINDS,
                                  actions=actions, move=move)


CHUNK_ROUND_TRIPS = 2
"""A chunk's round trips to the app's Redis, however many jobs it has: its read (the
scripts registered and every job's hash, registry entry and executions) and its swap
(every job's fenced move)."""


def test_a_chunk_retry_is_two_round_trips_refuses_the_moved_and_a_worker_runs_the_rest(
        project: RqProject, processes: Processes, markers: Markers) -> None:
    """Four failed jobs, a queued one and an unknown id retried as one chunk: the one RQ's
    own requeue took between the chunk's read and its swap is ``fence_lost`` (once on its
    queue, as RQ left it), the queued one is refused and unchanged, the unknown id is no
    job; the three others are requeued as RQ's requeue leaves a job (a fresh count, the
    resumes' retries given back), in two round trips; a real worker then runs all four
    on attempt 1."""
    retried = [project.enqueue(IDEMPOTENT, hang=[0], retry=2) for _ in range(3)]
    moved = project.enqueue(IDEMPOTENT, hang=[0])
    for job_id in (*retried, moved):
        failed(project, job_id)
    redis = project.redis()
    redis.hset(f"rq:job:{retried[0]}", "reconciler_attempt", 2)  # a resume's attempt
    waiting = project.enqueue(IDEMPOTENT, hang=[0])
    before = redis.hgetall(f"rq:job:{waiting}")
    client, sent = _counted_client(project.redis_url)
    desk = _chunk_desk(project, client, {moved: _requeued_by_rq(project)})
    reports = desk.act_on_chunk(OperatorAction.RETRY, [*retried, moved, waiting, "no-such"],
                                actor="alice", note="bulk")
    assert [(r.job_id, r.refusal) for r in reports] == [
        *((j, None) for j in retried), (moved, "fence_lost"),
        (waiting, "job_not_failed_or_cancelled"), ("no-such", "no_such_job")]
    assert len(sent) == CHUNK_ROUND_TRIPS
    queue = project.queue()
    assert queue.job_ids == [waiting, moved, *retried]
    assert redis.hgetall(f"rq:job:{waiting}") == before
    for job_id in retried:
        job = project.job(job_id)
        assert (job.get_status().value, job.started_at, job.ended_at) == ("queued", None,
                                                                          None)
        assert redis.hget(f"rq:job:{job_id}", "reconciler_attempt") is None
        assert job_id not in queue.failed_job_registry.get_job_ids()
    assert [project.job(j).retries_left for j in retried] == [3, 2, 2]
    worker = start_worker(processes, project, markers, "worker-a")
    for job_id in (*retried, moved):
        wait_status(project, job_id, "finished", worker=worker)
        assert project.job(job_id).return_value() == "done on attempt 1"


def test_a_chunk_cancel_is_two_round_trips_refuses_the_moved_and_no_worker_runs_the_rest(
        project: RqProject, processes: Processes, markers: Markers) -> None:
    """A chunk cancel of a queued job a worker's dequeue took (its id off the queue, its
    hash not yet written) and a deferred one RQ's own cancel ended, both between the
    chunk's read and its swap, three queued jobs, another deferred one, a failed one and
    an unknown id: the two moved are ``fence_lost`` (with the worker that took it;
    canceled as RQ wrote it), the failed one is refused, the unknown id is no job; the
    four others end as RQ's cancel leaves a job, in two round trips, and a real worker
    never runs them."""
    taken = project.enqueue(IDEMPOTENT, hang=[0])  # first on the queue: the one dequeued
    waiting = [project.enqueue(IDEMPOTENT, hang=[0]) for _ in range(3)]
    ended, deferred = (str(project.queue().enqueue(IDEMPOTENT, kwargs={"hang": [0]},
                                                   depends_on=waiting[0]).id)
                       for _ in range(2))
    gone = project.enqueue(IDEMPOTENT, hang=[0])
    failed(project, gone)
    client, sent = _counted_client(project.redis_url)
    desk = _chunk_desk(project, client, {taken: _taken_by_a_worker(project),
                                         ended: _canceled_by_rq(project)})
    chunk = [taken, ended, *waiting, deferred, gone, "no-such"]
    reports = desk.act_on_chunk(OperatorAction.CANCEL, chunk, actor="bob", note="bulk")
    assert [(r.job_id, r.refusal) for r in reports] == [
        (taken, "fence_lost"), (ended, "fence_lost"), *((j, None) for j in waiting),
        (deferred, None), (gone, "job_terminal"), ("no-such", "no_such_job")]
    assert len(sent) == CHUNK_ROUND_TRIPS
    queue = project.queue()
    assert (project.status(taken), project.status(ended), project.status(gone)) == (
        "queued", "canceled", "failed")
    assert queue.job_ids == []
    canceled = set(queue.canceled_job_registry.get_job_ids())
    assert canceled == {ended, *waiting, deferred}
    assert {project.status(j) for j in (*waiting, deferred)} == {"canceled"}
    assert deferred not in queue.deferred_job_registry.get_job_ids()
    worker = start_worker(processes, project, markers, "worker-a")
    later = project.enqueue(IDEMPOTENT, hang=[0])
    wait_status(project, later, "finished", worker=worker)
    for job_id in (taken, ended, *waiting, deferred):
        assert markers.of(job_id) == set()
