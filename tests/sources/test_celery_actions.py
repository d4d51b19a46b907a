"""Operator actions on Celery, on SQLite and PostgreSQL, with real Celery workers over a
real Redis: a retried task is re-published with its own id and the caller's
``AsyncResult`` completes on a new worker; a cancelled one is read ``REVOKED`` by the
caller and never run; a held stale task waits for its unhold; a task that moved meanwhile
is refused."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from models import OperatorAction as ActionRow
from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.vocabulary import Disposition, JobKey, OperatorAction, Reason
from reconciler.sources.celery.actions import CeleryActions
from tests.sources.actions_support import desk_for, desk_moving_after_read, forget_source
from tests.sources.celery_support import CeleryProject, kill_worker, worker_argv
from tests.sources.support import (
    RECOVERY_POLL_SECONDS,
    Markers,
    Process,
    Processes,
    reconcile_once,
    wait_until,
)
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

    return wait_until(decided, f"a decision on task {task_id}", timeout=30, process=worker,
                      every=RECOVERY_POLL_SECONDS)


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


MOVING: list[bool] = []
"""Not empty while the test's own write moves a task (its statement is not the chunk's)."""

UPKEEP = {b"PING", b"HELLO", b"CLIENT", b"AUTH", b"SELECT"}
"""The commands a Redis connection sends for itself."""

CHUNK_ROUND_TRIPS = 1
"""A chunk retry's round trips to Redis, however many tasks it has: its messages, pushed in
one pipeline (the queue declared already, by the caller's sends through this process's
kombu connection pool)."""

CHUNK_STATEMENTS = 2
"""A chunk's statements on the result table, however many tasks it has: its read (one
SELECT ... WHERE task_id IN) and its swap (one UPDATE, every row fenced inside it)."""


@contextmanager
def counted(project: CeleryProject) -> Iterator[tuple[list[str], list[bytes]]]:
    """The statements on the result table and the round trips to Redis (a pipeline,
    however long, is sent in one write and counts once) made meanwhile, save those of a
    ``MOVING`` write and a connection's upkeep (its handshake, redis-py's health check:
    when they fall is the pool's, not the chunk's)."""
    import redis  # noqa: PLC0415 - the Celery tests have it

    statements: list[str] = []
    sent: list[bytes] = []
    send = redis.connection.AbstractConnection.send_packed_command

    def statement(conn: object, cursor: object, text: str, *args: object) -> None:
        if project.table in text and not MOVING:
            statements.append(text)

    def round_trip(self: Any, command: Any, check_health: bool = True) -> None:
        packed = command if isinstance(command, bytes) else b"".join(command)
        if packed.split(b"\r\n")[2].upper() not in UPKEEP:
            sent.append(packed)
        send(self, command, check_health)  # type: ignore[no-untyped-call]

    sa.event.listen(project.engine, "before_cursor_execute", statement)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(redis.connection.AbstractConnection, "send_packed_command",
                          round_trip)
            yield statements, sent
    finally:
        sa.event.remove(project.engine, "before_cursor_execute", statement)


HANG = 5.0
"""Seconds each effectful task of a chunk runs on its first attempt."""


def threads_worker(processes: Processes, project: CeleryProject, markers: Markers, name: str,
                   threads: int) -> Process:
    """A worker running ``threads`` tasks at once, in one process."""
    return processes.start(name, worker_argv(name, "threads", concurrency=threads),
                           project.env(markers.folder), cwd=Path(__file__).parents[2])


def failed_by_a_pass(project: CeleryProject, processes: Processes, markers: Markers,
                     count: int) -> tuple[list[str], str]:
    """``count`` effectful tasks started by one worker (a thread pool), which first ends
    one more task ``SUCCESS`` and is then SIGKILLed; passes until each of the ``count``
    is ``FAILURE`` (``worker_died_mid_step``). Their ids, and the succeeded one's."""
    succeeded = send(project, "idem.work", hang=[0])
    # A run of HANG seconds: killed in the first, run to the end in a retry's (attempt 1).
    results = [send(project, "effect.work", hang=[HANG]) for _ in range(count)]
    worker = threads_worker(processes, project, markers, "worker-a", count + 1)
    tasks = [str(result.id) for result in results]
    assert succeeded.get(timeout=60) == "done on attempt 1"
    wait_until(lambda: all(markers.has(f"{t}-started-1") for t in tasks),
               "the tasks to start", process=worker)
    kill_worker(worker)
    reasons: dict[str, Reason] = {}

    def decided() -> bool:
        reasons.update({str(o.job_id): o.reason
                        for o in reconcile_once(project.engine, config(project), KINDS)
                        if o.applied})
        return set(tasks) <= set(reasons)

    wait_until(decided, "a decision on every task", process=worker, every=RECOVERY_POLL_SECONDS)
    assert {reasons[t] for t in tasks} == {Reason.WORKER_DIED_MID_STEP}
    assert {project.status(t) for t in tasks} == {"FAILURE"}
    return tasks, str(succeeded.id)


def test_a_chunk_retry_and_cancel_each_cost_a_single_actions_and_refuse_the_moved(
        project: CeleryProject, processes: Processes, markers: Markers) -> None:
    """Eight tasks a pass failed, a task that succeeded and an unknown id. One retried alone
    first; then the rest as one chunk, where one task a late write ended ``SUCCESS``
    between the chunk's read and its swap is ``fence_lost`` (left ``SUCCESS``, never
    re-published), the succeeded one is refused and unchanged, the unknown id is no job,
    and the other six are ``RETRY`` with a fresh count: each recorded, the chunk in one
    SELECT and one UPDATE of the result table and as many Redis round trips as the single
    retry's (its messages pushed in one pipeline). Three of those are then cancelled, one
    alone and two in a chunk with a retried task a late write marked ``STARTED`` after
    the chunk's read (``fence_lost``): the chunk's cancel costs the single cancel's
    statements and round trips. A real worker then runs the four tasks still retried to
    the end, on attempt 1, and never the moved one nor the three cancelled, whose callers
    read them revoked."""
    tasks, succeeded = failed_by_a_pass(project, processes, markers, 8)
    alone, retried, moved, doomed = tasks[0], tasks[1:4], tasks[4], tasks[5:8]
    done_before = project.row(succeeded)

    def moving(task: str, status: str) -> Callable[[Connection, JobKey], None]:
        def move(conn: Connection, key: JobKey) -> None:
            if key == task:
                MOVING.append(True)
                conn.execute(sa.text(f"UPDATE {project.table} SET status = :status "
                                     "WHERE task_id = :id"), {"id": key, "status": status})
                MOVING.clear()
        return move

    desk = desk_moving_after_read(project.engine, SOURCE, config(project), KINDS,
                                  actions=CeleryActions, move=moving(moved, "SUCCESS"))
    with counted(project) as (single_statements, single_trips):
        report = desk.act(OperatorAction.RETRY, alone, actor="alice", note="first")
    assert report.applied, report.line
    chunk = [*retried, *doomed, moved, succeeded, "no-such-task"]
    with counted(project) as (statements, trips):
        reports = desk.act_on_chunk(OperatorAction.RETRY, chunk, actor="alice", note="bulk")
    assert [(r.job_id, r.refusal) for r in reports] == [
        *((t, None) for t in (*retried, *doomed)), (moved, "fence_lost"),
        (succeeded, "job_not_failed_or_cancelled"), ("no-such-task", "no_such_job")]
    if project.engine.dialect.update_returning:  # MySQL swaps a moved row's chunk row by row
        assert len(statements) == len(single_statements) == CHUNK_STATEMENTS, statements
    assert len(trips) == len(single_trips) == CHUNK_ROUND_TRIPS, (trips, single_trips)
    assert [project.status(t) for t in (*retried, *doomed, moved)] == \
        ["RETRY"] * 6 + ["SUCCESS"]
    assert project.row(succeeded) == done_before
    for task in (*retried, *doomed):
        row = project.row(task)
        assert row is not None
        assert (row["retries"], row["date_done"]) == (0, None)
    actions = cast(sa.Table, ActionRow.__table__)
    with project.engine.connect() as conn:
        rows = conn.execute(sa.select(actions).where(actions.c.operator_note == "bulk"))
        recorded = {row.job_key: (row.refusal_reason, row.state_before, row.state_after)
                    for row in rows}
    assert recorded == {**{t: (None, "FAILURE", "RETRY") for t in (*retried, *doomed)},
                        moved: ("fence_lost", "FAILURE", "FAILURE"),
                        succeeded: ("job_not_failed_or_cancelled", "SUCCESS", "SUCCESS")}

    started = retried[2]
    canceller = desk_moving_after_read(project.engine, SOURCE, config(project), KINDS,
                                       actions=CeleryActions,
                                       move=moving(started, "STARTED"))
    with counted(project) as (single_statements, single_trips):
        report = canceller.act(OperatorAction.CANCEL, doomed[0], actor="bob", note="one")
    assert report.applied, report.line
    with counted(project) as (statements, trips):
        reports = canceller.act_on_chunk(OperatorAction.CANCEL, [*doomed[1:], started],
                                         actor="bob", note="stop")
    assert [(r.job_id, r.refusal) for r in reports] == [
        (doomed[1], None), (doomed[2], None), (started, "fence_lost")]
    if project.engine.dialect.update_returning:
        assert len(statements) == len(single_statements), (statements, single_statements)
    assert len(trips) == len(single_trips), (trips, single_trips)
    assert [project.status(t) for t in (*doomed, started)] == ["REVOKED"] * 3 + ["STARTED"]

    threads_worker(processes, project, markers, "worker-b", len(retried) + 2)
    caller = project.caller()
    for task in (alone, *retried):
        assert caller.AsyncResult(task).get(timeout=60) == "done on attempt 1"
    for task in doomed:
        with pytest.raises(Exception, match="revoked") as raised:
            caller.AsyncResult(task).get(timeout=5)
        assert type(raised.value).__name__ == "TaskRevokedError"
    ran = {t: markers.of(t) for t in (moved, *doomed)}
    assert ran == {t: {"started-1"} for t in ran}, "a moved or cancelled task ran again"
