"""Operator actions on Procrastinate (PostgreSQL), through its own functions, with real
Procrastinate workers: a retried job is run to the end by one, a cancelled one is read
``cancelled`` by Procrastinate and never run, a held stale job waits for its unhold, and a
job that moved meanwhile is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.vocabulary import Disposition, OperatorAction, Reason
from reconciler.sources.procrastinate.actions import ProcrastinateActions
from tests.sources.actions_support import (
    chunk_with_statements,
    desk_for,
    desk_moving_after_read,
    forget_source,
)
from tests.sources.conftest import SourcesDatabase
from tests.sources.factories import ProcrastinateFactory
from tests.sources.support import (
    Markers,
    Process,
    Processes,
    by_job,
    reconcile_once,
    wait_until,
)
from tests.sources.test_procrastinate_workers import KINDS, TIMEOUT_SECONDS

SOURCE = "procrastinate"
LONG_AGO = 3600.0


@pytest.fixture
def procrastinate(procrastinate_db: SourcesDatabase, procrastinate_schema: str
                  ) -> ProcrastinateFactory:
    """Procrastinate's tables, empty, and no record of an earlier test's jobs (its ids
    start again at 1)."""
    forget_source(procrastinate_db.engine, SOURCE)
    return ProcrastinateFactory(procrastinate_db, procrastinate_schema,
                                session_timeout_seconds=TIMEOUT_SECONDS)


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def desk_of(factory: ProcrastinateFactory) -> OperatorDesk:
    return desk_for(factory.db.engine, factory.config, KINDS)


def worker(processes: Processes, factory: ProcrastinateFactory, markers: Markers) -> Process:
    """A real Procrastinate worker process."""
    db = factory.db
    return processes.start("worker", [sys.executable, "-m", "tests.sources.procrastinate_app"], {
        "SOURCES_PG_CONNINFO": db.conninfo(f"{factory.schema},public"),
        "SOURCES_MARKERS": str(markers.folder), "SOURCES_DATABASE_URL": db.url,
        "SOURCES_STALLED_SECONDS": str(TIMEOUT_SECONDS)}, cwd=Path(__file__).parents[2])


def died(factory: ProcrastinateFactory, kind: str) -> int:
    """A job whose worker died mid-task; it runs at once (no hang) when run again."""
    job = factory.defer(kind, {"hang": []})
    factory.claim(job, heartbeat_age=LONG_AGO)
    return job


def test_retry_of_a_terminalized_job_is_finished_by_a_procrastinate_worker(
        procrastinate: ProcrastinateFactory, processes: Processes, markers: Markers) -> None:
    """Failed by a pass (effectful, died mid-task), retried with a note: ``todo`` through
    Procrastinate's retry function (its own ``retried`` event), attempts from 0, and a real worker
    runs it to the end."""
    job = died(procrastinate, "effect.work")
    outcome = by_job(reconcile_once(procrastinate.db.engine, procrastinate.config, KINDS))[job]
    assert outcome.reason is Reason.WORKER_DIED_MID_STEP
    desk = desk_of(procrastinate)
    assert desk.allowed(str(job)) == {OperatorAction.RETRY}
    report = desk.act(OperatorAction.RETRY, str(job), actor="alice", note="not charged")
    assert report.applied, report.line
    assert report.line.endswith("failed -> todo")
    row = procrastinate.row(job)
    assert row is not None
    assert (row["status"], row["attempts"]) == ("todo", 0)
    assert procrastinate.events(job)[-1] == "retried"  # Procrastinate's own trigger
    running = worker(processes, procrastinate, markers)
    wait_until(lambda: procrastinate.status(job) == "completed", "the retried job to finish",
               process=running)
    assert markers.has(f"{job}-done-0")
    again = desk.act(OperatorAction.RETRY, str(job), actor="alice", note="twice")
    assert again.refusal == "job_not_failed_or_cancelled"


def test_cancel_of_a_queued_job_is_read_cancelled_and_never_run(
        procrastinate: ProcrastinateFactory, processes: Processes, markers: Markers) -> None:
    """Procrastinate's cancel: ``cancelled`` in its own table; its worker runs a later job
    and never this one; a cancelled job is not retried (its retry takes failed jobs)."""
    job = procrastinate.defer("pure.work", {"hang": []})
    desk = desk_of(procrastinate)
    report = desk.act(OperatorAction.CANCEL, str(job), actor="bob", note="duplicate")
    assert report.applied, report.line
    assert procrastinate.status(job) == "cancelled"
    running = worker(processes, procrastinate, markers)
    later = procrastinate.defer("pure.work", {"hang": []})
    wait_until(lambda: procrastinate.status(later) == "completed", "a later job to run",
               process=running)
    assert markers.of(job) == set()
    refused = desk.act(OperatorAction.RETRY, str(job), actor="bob", note="after all")
    assert refused.refusal == "procrastinate_cannot_retry"


def test_cancel_of_a_running_job_asks_it_to_abort(
        procrastinate: ProcrastinateFactory) -> None:
    """A ``doing`` job: abort requested (the worker stops it where the task checks);
    asked again, refused."""
    job = procrastinate.live("idem.work")
    desk = desk_of(procrastinate)
    report = desk.act(OperatorAction.CANCEL, str(job), actor="c", note="stop it")
    assert report.applied, report.line
    assert "doing -> doing (abort requested)" in report.line
    again = desk.act(OperatorAction.CANCEL, str(job), actor="c", note="again")
    assert again.refusal == "abort_requested_already"


def test_a_held_stale_job_is_left_alone_until_unheld(
        procrastinate: ProcrastinateFactory) -> None:
    """Held: its dead worker's job is skipped ``operator_hold``, unchanged; unheld, the
    next pass resumes it through Procrastinate's retry."""
    job = died(procrastinate, "idem.work")
    desk = desk_of(procrastinate)
    assert desk.act(OperatorAction.HOLD, str(job), actor="d", note=None).applied
    engine = procrastinate.db.engine
    held = by_job(reconcile_once(engine, procrastinate.config, KINDS))[job]
    assert (held.disposition, held.reason) == (Disposition.SKIP, Reason.OPERATOR_HOLD)
    assert procrastinate.row(job)["status"] == "doing"  # type: ignore[index]
    assert desk.act(OperatorAction.UNHOLD, str(job), actor="d", note=None).applied
    resumed = by_job(reconcile_once(engine, procrastinate.config, KINDS))[job]
    assert resumed.disposition is Disposition.RESUME
    assert procrastinate.status(job) == "queued"


def test_an_action_on_a_job_that_moved_meanwhile_is_refused(
        procrastinate: ProcrastinateFactory) -> None:
    """The job changed after the action read it: ``fence_lost``, recorded, and the
    function is never called (the job is as its worker left it)."""
    job = procrastinate.live("idem.work")

    desk = desk_moving_after_read(
        procrastinate.db.engine, SOURCE, procrastinate.config, KINDS, actions=ProcrastinateActions,
        move=lambda conn, key: conn.execute(sa.text(
            "UPDATE procrastinate.procrastinate_jobs SET attempts = attempts + 1 "
            "WHERE id = :id"), {"id": key}))
    before = procrastinate.row(job)
    assert before is not None
    report = desk.act(OperatorAction.CANCEL, str(job), actor="e", note="n")
    assert (report.applied, report.refusal) == (False, "fence_lost")
    assert procrastinate.row(job) == {**before, "attempts": before["attempts"] + 1}


def test_a_chunk_is_retried_and_cancelled_through_its_functions_in_a_few_statements(
        procrastinate: ProcrastinateFactory, processes: Processes, markers: Markers) -> None:
    """A chunk cancel of two queued jobs (and an id no job has): both ``cancelled``; three
    jobs a pass failed, retried as a chunk: ``todo`` with their ``retried`` events and
    attempts from 0; a real worker runs the three and neither cancelled one."""
    engine = procrastinate.db.engine
    jobs = [died(procrastinate, "effect.work") for _ in range(3)]
    decided = by_job(reconcile_once(engine, procrastinate.config, KINDS))
    assert {decided[j].reason for j in jobs} == {Reason.WORKER_DIED_MID_STEP}
    queued = [procrastinate.defer("pure.work", {"hang": []}) for _ in range(2)]
    desk = desk_of(procrastinate)
    cancelled = desk.act_on_chunk(OperatorAction.CANCEL, [*map(str, queued), "999999"],
                                  actor="bob", note="duplicates")
    assert [(r.job_id, r.refusal) for r in cancelled] == [
        (str(queued[0]), None), (str(queued[1]), None), ("999999", "no_such_job")]
    retried = desk.act_on_chunk(OperatorAction.RETRY, list(map(str, jobs)), actor="alice",
                                note="checked")
    assert [(r.job_id, r.applied) for r in retried] == [(str(j), True) for j in jobs]
    assert retried[0].line.endswith("failed -> todo")
    for job in jobs:
        row = procrastinate.row(job)
        assert row is not None
        assert (row["status"], row["attempts"]) == ("todo", 0)
        assert procrastinate.events(job)[-1] == "retried"
    assert {procrastinate.status(j) for j in queued} == {"cancelled"}
    running = worker(processes, procrastinate, markers)
    for job in jobs:
        wait_until(lambda job=job: procrastinate.status(job) == "completed",
                   f"job {job} to finish", process=running)
    assert all(markers.of(job) == set() for job in queued)


def test_a_chunk_retry_refuses_a_moved_a_cancelled_and_a_lock_taken_job_and_applies_the_rest(
        procrastinate: ProcrastinateFactory, processes: Processes, markers: Markers) -> None:
    """Five jobs a pass failed, retried as a chunk with a cancelled job and an id no job
    has: one retried by Procrastinate meanwhile (after the chunk's read, before its swap)
    is ``fence_lost``, one whose queueing lock a queued job holds is refused by its unique
    index (``procrastinate_already_enqueued``), the cancelled one is
    ``procrastinate_cannot_retry``; the two others are ``todo`` with attempts from 0. A real
    worker runs those, the moved one and the lock's holder, never the cancelled one; the
    lock free again, the refused one is retried and run too."""
    engine = procrastinate.db.engine
    failed = [died(procrastinate, "effect.work") for _ in range(2)]
    moved, locked = died(procrastinate, "effect.work"), died(procrastinate, "effect.work")
    decided = by_job(reconcile_once(engine, procrastinate.config, KINDS))
    assert {decided[j].reason for j in (*failed, moved, locked)} == {
        Reason.WORKER_DIED_MID_STEP}
    holder = procrastinate.defer("pure.work", {"hang": []})
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE procrastinate.procrastinate_jobs SET queueing_lock = "
                             "'nightly' WHERE id IN (:a, :b)"), {"a": locked, "b": holder})
    cancelled = procrastinate.defer("pure.work", {"hang": []})
    desk = desk_of(procrastinate)
    assert desk.act(OperatorAction.CANCEL, str(cancelled), actor="bob", note="dup").applied

    def retried_by_procrastinate(conn: sa.Connection, key: object) -> None:
        if key == moved:  # its function and triggers name its tables unqualified
            conn.execute(sa.text("SELECT set_config('search_path', 'procrastinate, ' || "
                                 "current_setting('search_path'), true)"))
            conn.execute(sa.text("SELECT procrastinate_retry_job_v2(:id, NULL, NULL, NULL, "
                                 "NULL)"), {"id": key})

    moving = desk_moving_after_read(engine, SOURCE, procrastinate.config, KINDS,
                                    actions=ProcrastinateActions,
                                    move=retried_by_procrastinate)
    chunk = [*failed, moved, locked, cancelled]
    reports = moving.act_on_chunk(OperatorAction.RETRY, [*map(str, chunk), "999999"],
                                  actor="alice", note="bulk")
    assert [(r.job_id, r.refusal) for r in reports] == [
        *((str(j), None) for j in failed), (str(moved), "fence_lost"),
        (str(locked), "procrastinate_already_enqueued"),
        (str(cancelled), "procrastinate_cannot_retry"), ("999999", "no_such_job")]
    rows = {j: procrastinate.row(j) for j in chunk}
    assert {j: (r["status"], r["attempts"]) for j, r in rows.items() if r} == {
        **dict.fromkeys(failed, ("todo", 0)), moved: ("todo", 2), locked: ("failed", 1),
        cancelled: ("cancelled", 0)}
    assert {procrastinate.events(j)[-1] for j in failed} == {"retried"}
    running = worker(processes, procrastinate, markers)
    for job in (*failed, moved, holder):
        wait_until(lambda job=job: procrastinate.status(job) == "completed",
                   f"job {job} to finish", process=running)
    assert desk.act(OperatorAction.RETRY, str(locked), actor="alice", note="now").applied
    wait_until(lambda: procrastinate.status(locked) == "completed", "the refused job to run",
               process=running)
    assert markers.of(cancelled) == set()


def test_a_chunk_retry_costs_as_many_statements_for_six_jobs_as_for_two(
        procrastinate: ProcrastinateFactory) -> None:
    """A chunk's statements do not grow with its size: a fence read once per job made a
    chunk of 500 cost 500 statements of 500 fences each (a minute per chunk)."""
    chunks = ([died(procrastinate, "effect.work") for _ in range(2)],
              [died(procrastinate, "effect.work") for _ in range(6)])
    reconcile_once(procrastinate.db.engine, procrastinate.config, KINDS)
    desk = desk_of(procrastinate)
    counts = []
    for chunk in chunks:
        reports, statements = chunk_with_statements(desk, OperatorAction.RETRY,
                                                    [str(j) for j in chunk])
        assert [r.refusal for r in reports] == [None] * len(chunk)
        assert {procrastinate.status(j) for j in chunk} == {"queued"}
        counts.append(len(statements))
    assert counts[0] == counts[1], counts
