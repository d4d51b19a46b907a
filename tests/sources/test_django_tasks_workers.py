"""Real django-tasks-db workers (``manage.py db_worker``), SIGKILLed and SIGSTOPped
mid-task, recovered by the django-tasks source on SQLite and PostgreSQL.

Tasks are enqueued through Django's own API and every recovery is finished, or read, by
Django's own code: a new ``db_worker`` runs what was resumed, and Django's result API (in a
process where this project cannot be imported) reads what was failed.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.vocabulary import Disposition, EffectKind, Reason
from reconciler.sources.django_tasks import DjangoTasksConfig
from tests.sources.django_tasks_support import DjangoDatabase, DjangoTasksFactory, worker_argv
from tests.sources.support import (
    RECOVERY_POLL_SECONDS,
    Markers,
    Outcome,
    Process,
    Processes,
    reconcile_once,
    record_finding,
    wait_until,
)

MAX_RUN_SECONDS = 1.0  # the declared run time of the tasks whose workers are killed
TASKS = "tests.sources.django_app.tasks"
KINDS = KindRules([KindRule(f"{TASKS}.idem_work", effect=EffectKind.IDEMPOTENT),
                   KindRule(f"{TASKS}.*", max_run_seconds=MAX_RUN_SECONDS)],
                  # Below the ledger's last write at the kill: recent activity protects nothing.
                  stale_after_seconds=0.5, wedged_after_seconds=3600.0, max_attempts=3)
CONFIG = DjangoTasksConfig()


@pytest.fixture
def project(django_db: DjangoDatabase) -> DjangoTasksFactory:
    """The Django project's database on each engine, its task table empty."""
    return DjangoTasksFactory(django_db)


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def enqueue(project: DjangoTasksFactory, task: str, markers: Markers,
            **kwargs: Any) -> str:
    """``task.enqueue(**kwargs)`` through Django's own API; the result's id."""
    return project.db.manage("enqueue", task, json.dumps(kwargs),
                             markers=markers.folder).strip()


def start_worker(processes: Processes, project: DjangoTasksFactory, markers: Markers,
                 name: str) -> Process:
    """A ``db_worker`` of the backend, a process of its own."""
    return processes.start(name, worker_argv(), project.db.env(markers.folder),
                           cwd=Path(__file__).parents[2])


def recover(project: DjangoTasksFactory, job: str, worker: Process,
            kinds: KindRules = KINDS) -> Outcome:
    """Run passes until one changes the task (its declared run time passed)."""
    def decided() -> Outcome | None:
        for outcome in reconcile_once(project.engine, CONFIG, kinds):
            if outcome.job_id == job and outcome.applied:
                return outcome
        return None

    outcome: Outcome = wait_until(decided, f"a decision on task {job}", timeout=20,
                                  process=worker, every=RECOVERY_POLL_SECONDS)
    return outcome


def django_result(project: DjangoTasksFactory, job: str) -> dict[str, Any]:
    """What Django's own ``get_result`` says, read where this project is not importable."""
    result: dict[str, Any] = json.loads(project.db.manage("result", job))
    return result


class TestKilledWorker:
    """A worker SIGKILLed mid-task: its task is recovered the way its kind allows."""

    def test_idempotent_task_is_resumed_and_finished_by_a_new_db_worker(
            self, project: DjangoTasksFactory, processes: Processes, markers: Markers) -> None:
        """READY again, then run to the end by the backend's own next worker."""
        job = enqueue(project, "idem_work", markers)
        first = start_worker(processes, project, markers, "worker-a")
        wait_until(lambda: markers.has(f"{job}-started-1"), "the task to start", process=first)
        first.kill()
        killed_at = time.monotonic()
        second = start_worker(processes, project, markers, "worker-b")
        outcome = recover(project, job, first)
        decided_after = time.monotonic() - killed_at
        assert (outcome.disposition, outcome.reason) == (Disposition.RESUME,
                                                         Reason.RESUMED_IDEMPOTENT_STEP)
        wait_until(lambda: project.status(job) == "completed",
                   "the new worker to finish the task", process=second)
        assert markers.of(job) == {"started-1", "started-2", "done-2"}
        result = django_result(project, job)
        assert (result["status"], result["attempts"], result["return_value"]) == (
            "SUCCESSFUL", 2, "done on attempt 2")
        record_finding("django-tasks", "killed_worker_recovered", job_id=job,
                       engine=project.db.engine_name, decision=outcome.reason.value,
                       decided_seconds_after_kill=round(decided_after, 2), result=result)

    def test_effectful_task_is_failed_readably_and_never_rerun(
            self, project: DjangoTasksFactory, processes: Processes, markers: Markers) -> None:
        """FAILED with our reason, as Django's own result API reads it; no worker runs it."""
        job = enqueue(project, "effect_work", markers)
        first = start_worker(processes, project, markers, "worker-a")
        wait_until(lambda: markers.has(f"{job}-started-1"), "the task to start", process=first)
        first.kill()
        second = start_worker(processes, project, markers, "worker-b")
        outcome = recover(project, job, first)
        assert outcome.reason is Reason.WORKER_DIED_MID_STEP
        # The new worker runs a later task to the end: it has polled past the failed one.
        later = enqueue(project, "idem_work", markers, hang=[])
        wait_until(lambda: project.status(later) == "completed", "a later task to run",
                   process=second)
        assert markers.of(job) == {"started-1"}
        result = django_result(project, job)
        assert result["status"] == "FAILED"
        assert result["finished"]
        [error] = result["errors"]
        assert error["exception_class"] == "builtins.RuntimeError"
        assert error["traceback"].strip().splitlines()[-1] == "RuntimeError: worker_died_mid_step"

    def test_steps_recorded_in_the_ledger_resume_at_the_first_unstarted_step(
            self, project: DjangoTasksFactory, processes: Processes, markers: Markers) -> None:
        """fetch succeeded, the worker died before charge: the re-run skips fetch."""
        job = enqueue(project, "ledger_charge", markers, hang_after="fetch")
        first = start_worker(processes, project, markers, "worker-a")
        wait_until(lambda: markers.has(f"{job}-step-fetch-1"), "fetch to run", process=first)
        time.sleep(0.2)  # fetch's success is recorded as its block ends
        first.kill()
        second = start_worker(processes, project, markers, "worker-b")
        # The ledger's last write must be older than stale_after_seconds, or the pass skips
        # the task as recently active (recorded once, not on every pass).
        time.sleep(KINDS.resolve_defaults().thresholds.stale_after_seconds)
        outcome = recover(project, job, first)
        assert (outcome.reason, outcome.resume_step_index) == (
            Reason.RESUMED_FROM_UNSTARTED_STEP, 1)
        wait_until(lambda: project.status(job) == "completed", "the re-run to finish",
                   process=second)
        assert markers.of(job) == {"pending-1-0,1,2", "step-fetch-1", "pending-2-1,2",
                                   "step-charge-2", "step-notify-2", "done-2"}


class TestLiveWorker:
    """A task inside its declared run time is never touched, however often passes run."""

    def test_running_task_within_max_run_seconds_is_left_alone(
            self, project: DjangoTasksFactory, processes: Processes, markers: Markers) -> None:
        kinds = KindRules([KindRule(f"{TASKS}.*", effect=EffectKind.IDEMPOTENT,
                                    max_run_seconds=3600.0)],
                          stale_after_seconds=0.5, wedged_after_seconds=3600.0, max_attempts=3)
        job = enqueue(project, "idem_work", markers)
        worker = start_worker(processes, project, markers, "worker-a")
        wait_until(lambda: markers.has(f"{job}-started-1"), "the task to start", process=worker)
        before = project.row(job)
        for _ in range(5):
            assert reconcile_once(project.engine, CONFIG, kinds) == []
            time.sleep(0.2)
        assert project.row(job) == before
        assert worker.alive()


class TestLateWriter:
    """The old worker SIGSTOPped past its run time, its task failed, then SIGCONTed."""

    def test_a_late_worker_overwrites_the_failure_by_id(
            self, project: DjangoTasksFactory, processes: Processes, markers: Markers) -> None:
        """The backend writes a task's end by id only: the old worker's success replaces
        our FAILED. docs/sources.md's late-writer table says so; the audit keeps ours."""
        job = enqueue(project, "effect_work", markers, hang=[3.0])
        old = start_worker(processes, project, markers, "worker-old")
        wait_until(lambda: markers.has(f"{job}-started-1"), "the task to start", process=old)
        old.signal(signal.SIGSTOP)
        outcome = recover(project, job, old)
        assert outcome.reason is Reason.WORKER_DIED_MID_STEP
        assert project.status(job) == "failed"
        old.signal(signal.SIGCONT)
        wait_until(lambda: markers.has(f"{job}-done-1"), "the old run to end", process=old)
        wait_until(lambda: project.status(job) != "failed", "the old worker's write",
                   process=old)
        result = django_result(project, job)
        record_finding("django-tasks", "late_writer", job_id=job,
                       engine=project.db.engine_name, result=result)
        assert (result["status"], result["errors"]) == ("SUCCESSFUL", [])
