"""Operator actions on graphile-worker (PostgreSQL), through its own functions, with real
graphile-worker workers (Node): a retried job is run to the end by one, a cancelled one is
failed for good with ``operator_cancel`` and never run, a running one is refused, a held
stale job waits for its unhold, and a job that moved meanwhile is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.vocabulary import Disposition, OperatorAction, Reason
from reconciler.sources.graphile_worker.actions import GraphileWorkerActions
from tests.sources.actions_support import desk_for, desk_moving_after_read, forget_source
from tests.sources.factories import GraphileWorkerFactory
from tests.sources.support import Markers, Processes, by_job, reconcile_once, wait_until
from tests.sources.test_node_workers import KINDS, NodeSystem

SOURCE = "graphile-worker"
LONG_AGO = 3600.0


@pytest.fixture
def graphile(request: pytest.FixtureRequest, node_modules: Path, tmp_path: Path
             ) -> NodeSystem:
    """graphile-worker on empty tables, with no record of an earlier test's jobs."""
    factory = GraphileWorkerFactory(request.getfixturevalue("graphile_db"),
                                    request.getfixturevalue("graphile_schema"))
    forget_source(factory.db.engine, SOURCE)
    return NodeSystem(SOURCE, factory, node_modules, Markers(tmp_path / "markers"))


def factory_of(system: NodeSystem) -> GraphileWorkerFactory:
    assert isinstance(system.factory, GraphileWorkerFactory)
    return system.factory


def desk_of(system: NodeSystem) -> OperatorDesk:
    engine = system.factory.db.engine
    return desk_for(engine, system.factory.config, KINDS)


def died(system: NodeSystem, kind: str) -> int:
    """A job whose worker died long ago; it runs at once when run again."""
    factory = factory_of(system)
    job = factory.add(kind, {"hang": []})
    factory.claim(job, age=LONG_AGO)
    return job


def test_retry_of_a_terminalized_job_is_finished_by_a_graphile_worker(
        graphile: NodeSystem, processes: Processes) -> None:
    """Failed by a pass, retried with a note through ``reschedule_jobs``: waiting, its
    attempts from 0; a real graphile-worker runs it to the end (and deletes it)."""
    job = died(graphile, "effect.work")
    engine = graphile.factory.db.engine
    outcome = by_job(reconcile_once(engine, graphile.factory.config, KINDS))[job]
    assert outcome.reason is Reason.WORKER_DIED_MID_STEP
    desk = desk_of(graphile)
    report = desk.act(OperatorAction.RETRY, str(job), actor="alice", note="not charged")
    assert report.applied, report.line
    row = graphile.row(job)
    assert row is not None
    assert (row["locked_at"], row["attempts"], row["runnable"]) == (None, 0, True)
    worker = graphile.start(processes, "worker")
    wait_until(lambda: graphile.done(job), "the retried job to finish", process=worker)
    assert graphile.markers.has(f"{job}-done-1")


def test_cancel_fails_a_waiting_job_for_good_and_it_never_runs(
        graphile: NodeSystem, processes: Processes) -> None:
    """``permanently_fail_jobs`` with ``operator_cancel``: never run by a worker."""
    factory = factory_of(graphile)
    job = factory.add("pure.work", {"hang": []})
    desk = desk_of(graphile)
    report = desk.act(OperatorAction.CANCEL, str(job), actor="bob", note="duplicate")
    assert report.applied, report.line
    assert (factory.status(job), factory.error_text(job)) == ("failed", "operator_cancel")
    worker = graphile.start(processes, "worker")
    later = factory.add("pure.work", {"hang": []})
    wait_until(lambda: graphile.done(later), "a later job to run", process=worker)
    assert graphile.markers.of(job) == set()


def test_cancel_of_a_locked_job_is_refused(graphile: NodeSystem) -> None:
    """A running job: ``graphile_worker_locked``, unchanged."""
    factory = factory_of(graphile)
    job = factory.live("idem.work")
    before = graphile.row(job)
    report = desk_of(graphile).act(OperatorAction.CANCEL, str(job), actor="c", note="n")
    assert report.refusal == "graphile_worker_locked"
    assert graphile.row(job) == before


def test_a_held_stale_job_is_left_alone_until_unheld(graphile: NodeSystem) -> None:
    """Held: skipped ``operator_hold``, unchanged; unheld, the next pass decides it."""
    job = died(graphile, "idem.work")
    desk = desk_of(graphile)
    assert desk.act(OperatorAction.HOLD, str(job), actor="d", note=None).applied
    engine = graphile.factory.db.engine
    held = by_job(reconcile_once(engine, graphile.factory.config, KINDS))[job]
    assert (held.disposition, held.reason) == (Disposition.SKIP, Reason.OPERATOR_HOLD)
    assert factory_of(graphile).status(job) == "running"
    assert desk.act(OperatorAction.UNHOLD, str(job), actor="d", note=None).applied
    resumed = by_job(reconcile_once(engine, graphile.factory.config, KINDS))[job]
    assert resumed.disposition is Disposition.RESUME


def test_an_action_on_a_job_that_moved_meanwhile_is_refused(graphile: NodeSystem) -> None:
    """``fence_lost``, recorded; the job is as the system left it."""
    factory = factory_of(graphile)
    job = factory.add("pure.work", {"hang": []})

    desk = desk_moving_after_read(
        factory.db.engine, SOURCE, factory.config, KINDS, actions=GraphileWorkerActions,
        move=lambda conn, key: conn.execute(sa.text(
            "UPDATE graphile_worker._private_jobs SET attempts = attempts + 1 WHERE id = :id"),
            {"id": key}))
    before = graphile.row(job)
    assert before is not None
    report = desk.act(OperatorAction.CANCEL, str(job), actor="e", note="n")
    assert (report.applied, report.refusal) == (False, "fence_lost")
    assert graphile.row(job) == {**before, "attempts": before["attempts"] + 1}


def test_a_chunk_is_retried_by_one_call_and_a_real_worker_runs_them(
        graphile: NodeSystem, processes: Processes) -> None:
    """Three jobs a pass failed, one of them retried meanwhile by another operator, an id
    no job has: one ``reschedule_jobs`` call retries the two still failed, the queued one
    is refused, the unknown id names no job; a real graphile-worker runs all three."""
    engine = graphile.factory.db.engine
    jobs = [died(graphile, "effect.work") for _ in range(3)]
    decided = by_job(reconcile_once(engine, graphile.factory.config, KINDS))
    assert {decided[j].reason for j in jobs} == {Reason.WORKER_DIED_MID_STEP}
    desk = desk_of(graphile)
    assert desk.act(OperatorAction.RETRY, str(jobs[0]), actor="bob", note="mine").applied
    reports = desk.act_on_chunk(OperatorAction.RETRY, [*map(str, jobs), "999999"],
                                actor="alice", note="bulk")
    assert [(r.job_id, r.refusal) for r in reports] == [
        (str(jobs[0]), "job_not_failed_or_cancelled"), (str(jobs[1]), None),
        (str(jobs[2]), None), ("999999", "no_such_job")]
    worker = graphile.start(processes, "worker")
    for job in jobs:
        wait_until(lambda job=job: graphile.done(job), f"job {job} to finish", process=worker)


def test_a_chunk_retry_refuses_a_moved_and_a_running_job_and_applies_the_rest(
        graphile: NodeSystem, processes: Processes) -> None:
    """Four jobs a pass failed, retried as a chunk with a running job and an id no job has:
    one rescheduled by graphile-worker's own function after the chunk's read (before its
    swap) is ``fence_lost`` and keeps that reschedule, the running one is refused and stays
    locked; the two others are waiting with attempts from 0, and a real graphile-worker
    runs them and the moved one."""
    factory = factory_of(graphile)
    engine = factory.db.engine
    failed = [died(graphile, "effect.work") for _ in range(3)]
    moved = died(graphile, "effect.work")
    decided = by_job(reconcile_once(engine, factory.config, KINDS))
    assert {decided[j].reason for j in (*failed, moved)} == {Reason.WORKER_DIED_MID_STEP}
    running = factory.live("idem.work")
    desk = desk_moving_after_read(
        engine, SOURCE, factory.config, KINDS, actions=GraphileWorkerActions,
        move=lambda conn, key: key == moved and conn.execute(sa.text(
            "SELECT id FROM graphile_worker.reschedule_jobs(ARRAY[CAST(:id AS bigint)], "
            "now(), NULL, 1, NULL)"), {"id": key}))
    before = graphile.row(running)
    reports = desk.act_on_chunk(OperatorAction.RETRY, [
        *map(str, (*failed, moved, running)), "999999"], actor="alice", note="bulk")
    assert [(r.job_id, r.refusal) for r in reports] == [
        *((str(j), None) for j in failed), (str(moved), "fence_lost"),
        (str(running), "job_not_failed_or_cancelled"), ("999999", "no_such_job")]
    rows = {j: graphile.row(j) for j in (*failed, moved)}
    assert {j: (r["locked_at"], r["attempts"], r["runnable"]) for j, r in rows.items() if r
            } == {**dict.fromkeys(failed, (None, 0, True)), moved: (None, 1, True)}
    assert graphile.row(running) == before
    worker = graphile.start(processes, "worker")
    for job in (*failed, moved):
        wait_until(lambda job=job: graphile.done(job), f"job {job} to finish", process=worker)
