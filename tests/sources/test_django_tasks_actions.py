"""Operator actions on Django's tasks framework (django-tasks-db), on SQLite and PostgreSQL,
in its own statuses, with real ``db_worker`` processes: a retried task is run to the end by
one, a cancelled one is read FAILED with ``operator_cancel`` by Django's own result API and
never run, a held stale task waits for its unhold, and a task that moved meanwhile is
refused."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from reconciler.cli.explain_view import explain_lines, explain_view
from reconciler.core.kinds import KindRules
from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.passes import explain_by_kind
from reconciler.core.vocabulary import Disposition, JobKey, OperatorAction, Reason
from reconciler.root.cli import assemble_cli
from reconciler.sources.django_tasks.actions import DjangoTasksActions
from reconciler.storage.clock import now_plus
from reconciler.views import job_view
from tests.sources.actions_support import desk_for, desk_moving_after_read, forget_source
from tests.sources.django_tasks_support import DjangoDatabase, DjangoTasksFactory, set_ledger
from tests.sources.support import (
    Markers,
    Processes,
    by_job,
    config_for,
    reconcile_once,
    wait_until,
)
from tests.sources.test_django_tasks_workers import (
    CONFIG,
    KINDS,
    django_result,
    enqueue,
    start_worker,
)

SOURCE = "django-tasks"
LONG_AGO = 3600.0


@pytest.fixture
def project(django_db: DjangoDatabase) -> DjangoTasksFactory:
    """The Django project's database, its task table empty, and no record of an earlier
    test's tasks."""
    factory = DjangoTasksFactory(django_db)
    forget_source(factory.engine, SOURCE)
    return factory


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def desk_of(project: DjangoTasksFactory) -> OperatorDesk:
    return desk_for(project.engine, CONFIG, KINDS)


def died(project: DjangoTasksFactory, task: str, markers: Markers) -> str:
    """A task enqueued through Django, claimed by a worker that died long ago; it runs at
    once when run again."""
    job = enqueue(project, task, markers, hang=[])
    project.claim(job, age=LONG_AGO)
    return job


def test_retry_of_a_terminalized_task_is_finished_by_a_db_worker(
        project: DjangoTasksFactory, processes: Processes, markers: Markers) -> None:
    """FAILED by a pass, retried with a note: READY as enqueued, its attempts from none;
    a real ``db_worker`` runs it, and Django reads it SUCCESSFUL on its first attempt."""
    job = died(project, "effect_work", markers)
    outcome = by_job(reconcile_once(project.engine, CONFIG, KINDS))[job]
    assert outcome.reason is Reason.WORKER_DIED_MID_STEP
    desk = desk_of(project)
    report = desk.act(OperatorAction.RETRY, job, actor="alice", note="not charged")
    assert report.applied, report.line
    assert report.line.endswith("FAILED -> READY")
    row = project.row(job)
    assert row is not None
    assert (row["status"], row["worker_ids"], row["started_at"], row["traceback"]) == (
        "READY", [], None, "")
    worker = start_worker(processes, project, markers, "worker")
    wait_until(lambda: project.status(job) == "completed", "the retried task to finish",
               process=worker)
    result = django_result(project, job)
    assert (result["status"], result["attempts"]) == ("SUCCESSFUL", 1)


def test_cancel_is_read_failed_by_django_and_never_run(
        project: DjangoTasksFactory, processes: Processes, markers: Markers) -> None:
    """A READY task cancelled: FAILED, ``RuntimeError: operator_cancel`` as Django's
    result reads it; its worker runs a later task and never this one."""
    job = enqueue(project, "pure_work", markers, hang=[])
    desk = desk_of(project)
    report = desk.act(OperatorAction.CANCEL, job, actor="bob", note="duplicate")
    assert report.applied, report.line
    worker = start_worker(processes, project, markers, "worker")
    later = enqueue(project, "idem_work", markers, hang=[])
    wait_until(lambda: project.status(later) == "completed", "a later task to run",
               process=worker)
    assert markers.of(job) == set()
    result = django_result(project, job)
    assert result["status"] == "FAILED"
    [error] = result["errors"]
    assert error["traceback"].strip().splitlines()[-1] == "RuntimeError: operator_cancel"
    assert desk.act(OperatorAction.CANCEL, job, actor="bob", note="again").refusal == \
        "job_terminal"


def test_a_held_stale_task_is_left_alone_until_unheld(
        project: DjangoTasksFactory, markers: Markers) -> None:
    """Held: skipped ``operator_hold``, RUNNING still; unheld, the next pass decides it."""
    job = died(project, "idem_work", markers)
    desk = desk_of(project)
    assert desk.act(OperatorAction.HOLD, job, actor="d", note=None).applied
    held = by_job(reconcile_once(project.engine, CONFIG, KINDS))[job]
    assert (held.disposition, held.reason) == (Disposition.SKIP, Reason.OPERATOR_HOLD)
    assert project.status(job) == "running"
    assert desk.act(OperatorAction.UNHOLD, job, actor="d", note=None).applied
    resumed = by_job(reconcile_once(project.engine, CONFIG, KINDS))[job]
    assert resumed.disposition is Disposition.RESUME


def _uuid(job_key: JobKey) -> uuid.UUID:
    return uuid.UUID(str(job_key))


def test_an_action_on_a_task_that_moved_meanwhile_is_refused(
        project: DjangoTasksFactory, markers: Markers) -> None:
    """A worker claimed it after the read: ``fence_lost``, recorded, nothing else."""
    job = enqueue(project, "pure_work", markers, hang=[])

    desk = desk_moving_after_read(
        project.engine, SOURCE, CONFIG, KINDS, actions=DjangoTasksActions,
        move=lambda conn, key: conn.execute(project.table.update().where(
            project.table.c.id == _uuid(key)).values(status="RUNNING")))
    report = desk.act(OperatorAction.CANCEL, job, actor="e", note="n")
    assert (report.applied, report.refusal) == (False, "fence_lost")
    assert project.status(job) == "running"


def test_a_retry_never_lets_a_paused_worker_of_the_ended_run_write_again(
        project: DjangoTasksFactory, markers: Markers) -> None:
    """A task's worker paused inside its effectful step (not dead) is failed by a pass; an
    operator retries it, and Django counts its next run from attempt 1 again. That run
    opens and gets the step back (the operator released it); the paused run, waking up
    under the same attempt number, records nothing: its step's end is refused
    (``LeaseLost``) and the new run's record stands."""
    from reconciler.ledger import LeaseLost, Step, StepLedger  # noqa: PLC0415

    plan = [Step("render", "idempotent"), Step("charge", "effectful")]
    job = died(project, "effect_work", markers)
    with StepLedger(project.engine) as ledger:
        paused = ledger.run(SOURCE, job, 1, plan)
        with paused.step(0):
            pass
        inside_charge = paused.step(1)
        inside_charge.__enter__()  # the worker stops here, for an hour
        set_ledger(project.engine, SOURCE, job, updated_at=now_plus(-LONG_AGO))
        outcome = by_job(reconcile_once(project.engine, CONFIG, KINDS))[job]
        assert outcome.reason is Reason.WORKER_DIED_MID_STEP
        report = desk_of(project).act(OperatorAction.RETRY, job, actor="alice",
                                      note="checked: not charged")
        assert report.applied, report.line
        fresh = ledger.run(SOURCE, job, 1, plan)  # Django's attempt count starts again
        assert fresh.pending() == [1]
        with pytest.raises(LeaseLost):
            inside_charge.__exit__(None, None, None)  # the paused worker wakes up
        with fresh.step(1):
            pass


def test_a_cancelled_task_shows_operator_cancel_in_every_view(
        project: DjangoTasksFactory, markers: Markers) -> None:
    """Django keeps the cancel in its traceback only: ``jobs show``, ``jobs list`` and the
    console read it as the reason all the same, and the time it ended."""
    job = enqueue(project, "pure_work", markers, hang=[])
    report = desk_of(project).act(OperatorAction.CANCEL, job, actor="bob", note="duplicate")
    assert report.applied, report.line
    jobs = assemble_cli(config_for(project.engine, CONFIG, KINDS), engine=project.engine).jobs
    shown = jobs.get_job(job)
    assert shown is not None
    assert (shown.job_status, shown.status_reason) == ("failed", "operator_cancel")
    assert shown.finished_at is not None
    assert shown.finished_at.tzinfo is not None
    [listed] = [j for j in jobs.list_jobs(None, 10) if str(j.job_id) == job]
    assert job_view(listed) == job_view(shown)


def test_a_kind_without_max_run_seconds_is_explained_as_never_reclaimed(
        project: DjangoTasksFactory, markers: Markers) -> None:
    """Django keeps no lease: a running task of a kind that sets no ``max_run_seconds``
    is left alone by every pass, for ever. ``jobs explain`` says so, not that its worker
    is alive; the same task under a kind that sets one is not."""
    job = enqueue(project, "pure_work", markers, hang=[])
    project.claim(job, age=LONG_AGO)
    no_lease = KindRules([], stale_after_seconds=0.5, wedged_after_seconds=3600.0,
                         max_attempts=3)
    for kinds, never in ((no_lease, True), (KINDS, False)):
        parts = assemble_cli(config_for(project.engine, CONFIG, kinds), engine=project.engine)
        [explained] = explain_by_kind(parts.passes, [parts.config.source_entry
                                                     .parse_job_key(job)],
                                      parts.config.pass_config("test"))
        view = explain_view(explained, kinds, parts.jobs.get_job(job))
        assert view["never_reclaimed"] is never
        lines = explain_lines(view)
        assert any(line.startswith("  never reclaimed:") for line in lines) is never
        if never:
            assert (view["disposition"], view["reason"]) == ("skip", "lease_live")
    assert project.status(job) == "running"


def test_a_chunk_is_retried_in_one_statement_and_a_db_worker_runs_them(
        project: DjangoTasksFactory, processes: Processes, markers: Markers) -> None:
    """Three tasks a pass failed, one retried meanwhile by another operator, an id no task
    has: the chunk's retry puts the two still failed ``READY`` in one statement, refuses
    the third (ready now), names no task for the unknown id; a real ``db_worker`` runs all
    three and Django reads each SUCCESSFUL on its first attempt."""
    tasks = [died(project, "effect_work", markers) for _ in range(3)]
    decided = by_job(reconcile_once(project.engine, CONFIG, KINDS))
    assert {decided[t].reason for t in tasks} == {Reason.WORKER_DIED_MID_STEP}
    desk = desk_of(project)
    assert desk.act(OperatorAction.RETRY, tasks[0], actor="bob", note="mine").applied
    unknown = str(uuid.UUID(int=7))
    reports = desk.act_on_chunk(OperatorAction.RETRY, [*tasks, unknown], actor="alice",
                                note="bulk")
    assert [(r.job_id, r.refusal) for r in reports] == [
        (tasks[0], "job_not_failed_or_cancelled"), (tasks[1], None), (tasks[2], None),
        (unknown, "no_such_job")]
    worker = start_worker(processes, project, markers, "worker")
    for task in tasks:
        wait_until(lambda task=task: project.status(task) == "completed",
                   f"task {task} to finish", process=worker)
        result = django_result(project, task)
        assert (result["status"], result["attempts"]) == ("SUCCESSFUL", 1)


def test_a_chunk_retry_refuses_a_moved_and_a_running_task_and_applies_the_rest(
        project: DjangoTasksFactory, processes: Processes, markers: Markers) -> None:
    """Three tasks a pass failed, retried as a chunk with a running task and an id no task
    has: one a late worker ended SUCCESSFUL after the chunk's read (by id only, as Django's
    backend writes an end; before the swap) is ``fence_lost`` and stays SUCCESSFUL, the
    running one is refused and unchanged; the two others are READY as enqueued, in the
    one UPDATE, and a real ``db_worker`` runs them on their first attempt."""
    failed = [died(project, "effect_work", markers) for _ in range(2)]
    moved = died(project, "effect_work", markers)
    decided = by_job(reconcile_once(project.engine, CONFIG, KINDS))
    assert {decided[t].reason for t in (*failed, moved)} == {Reason.WORKER_DIED_MID_STEP}
    running = project.live("pure_work")
    before = project.row(running)
    desk = desk_moving_after_read(
        project.engine, SOURCE, CONFIG, KINDS, actions=DjangoTasksActions,
        move=lambda conn, key: str(key) == moved and conn.execute(
            project.table.update().where(project.table.c.id == _uuid(key))
            .values(status="SUCCESSFUL")))
    unknown = str(uuid.UUID(int=7))
    reports = desk.act_on_chunk(OperatorAction.RETRY, [*failed, moved, running, unknown],
                                actor="alice", note="bulk")
    assert [(r.job_id, r.refusal) for r in reports] == [
        *((t, None) for t in failed), (moved, "fence_lost"),
        (running, "job_not_failed_or_cancelled"), (unknown, "no_such_job")]
    assert [project.status(t) for t in (*failed, moved)] == ["queued", "queued", "completed"]
    assert project.row(running) == before
    worker = start_worker(processes, project, markers, "worker")
    for task in failed:
        wait_until(lambda task=task: project.status(task) == "completed",
                   f"task {task} to finish", process=worker)
        result = django_result(project, task)
        assert (result["status"], result["attempts"]) == ("SUCCESSFUL", 1)
