"""The step ledger from inside an RQ job (``reconciler.ledger.StepLedger``, source
``rq``), with the reconciler's own tables on SQLite and PostgreSQL and real ``rq
worker`` processes SIGKILLed mid-job: a pass resumes the job at the first step that never
started, and a new worker runs only the steps left; a job killed inside an effectful step
is failed with ``worker_died_mid_step``, read through RQ's own ``Job.fetch``."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.config.loader import Config
from reconciler.config.settings import Settings
from reconciler.core.ports import SourceJobs
from reconciler.core.vocabulary import Disposition, Reason
from reconciler.root.cli import assemble_cli
from reconciler.views import job_lines, job_list_lines, job_view, with_history
from tests.sources.rq_support import (
    RqProject,
    rq_project,
    sigkill,
    unique,
    wait_status,
    worker_argv,
)
from tests.sources.support import Markers, Process, Processes, by_job, reconcile_once, wait_until
from tests.sources.test_rq_workers import KINDS

__all__ = ["rq_project"]  # a fixture, found by name


def jobs_of(project: RqProject) -> SourceJobs:
    """The rq source's jobs as ``reconciler jobs`` reads them."""
    settings = Settings(database_url=project.engine.url.render_as_string(hide_password=False))
    return assemble_cli(Config(settings=settings, source=project.config(), kinds=KINDS),
                        engine=project.engine).jobs
LEDGER_CHARGE = "tests.sources.rq_operator_tasks.ledger_charge"
REPO = Path(__file__).parents[2]


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def start(processes: Processes, project: RqProject, markers: Markers, name: str) -> Process:
    """An ``rq worker`` whose jobs record their steps in the reconciler's database."""
    url = project.engine.url.render_as_string(hide_password=False)
    name = unique(name)
    return processes.start(name, worker_argv(project, name),
                           {"SOURCES_MARKERS": str(markers.folder),
                            "RECONCILER_DATABASE_URL": url}, cwd=REPO)


def test_a_pass_resumes_at_the_first_step_that_never_started(
        rq_project: RqProject, processes: Processes, markers: Markers) -> None:
    """Killed after ``fetch`` succeeded, before ``charge`` started: resumed at step 1
    (the kind is effectful, but no effectful step ever started); the new worker runs
    ``charge`` and ``notify`` only."""
    job_id = rq_project.enqueue(LEDGER_CHARGE, hang="between")
    first = start(processes, rq_project, markers, "worker-a")
    wait_until(lambda: markers.has(f"{job_id}-between-1"), "fetch to succeed",
               process=first)
    sigkill(first)
    rq_project.expire_as_time_would(job_id, first)
    outcome = by_job(reconcile_once(rq_project.engine, rq_project.config(), KINDS))[job_id]
    assert (outcome.disposition, outcome.resume_step_index) == (Disposition.RESUME, 1)
    # What ``jobs show`` and ``jobs list`` say: the steps the ledger read, the step the pass
    # resumed at, and the decision with it.
    jobs = jobs_of(rq_project)
    shown = jobs.get_job(job_id)
    assert shown is not None
    view = with_history(job_view(shown), jobs.decisions_about(job_id, 5), [])
    assert [(s["name"], s["state"]) for s in view["steps"]][:2] == [
        ("fetch", "succeeded"), ("charge", "not_started")]
    assert view["resume_step_index"] == 1
    assert any("decided: resume at step 1 (" in line for line in job_lines(view, "rq"))
    [line] = [v for v in job_list_lines([job_view(j) for j in jobs.list_jobs(None, 10)])
              if job_id in v]
    assert line.split()[4] == "1"  # the STEP column
    second = start(processes, rq_project, markers, "worker-b")
    wait_status(rq_project, job_id, "finished", worker=second)
    assert rq_project.job(job_id).return_value() == "done on attempt 2"
    assert markers.of(job_id) == {"step-fetch-1", "between-1", "step-charge-2",
                                  "step-notify-2"}


def test_a_job_killed_inside_an_effectful_step_is_failed(
        rq_project: RqProject, processes: Processes, markers: Markers) -> None:
    """Killed inside ``charge``: ``worker_died_mid_step``, RQ reads it failed with our
    reason, and a new worker never runs it again."""
    job_id = rq_project.enqueue(LEDGER_CHARGE, hang="charge", retry=3)
    first = start(processes, rq_project, markers, "worker-a")
    wait_until(lambda: markers.has(f"{job_id}-step-charge-1"), "charge to start",
               process=first)
    sigkill(first)
    rq_project.expire_as_time_would(job_id, first)
    outcome = by_job(reconcile_once(rq_project.engine, rq_project.config(), KINDS))[job_id]
    assert (outcome.disposition, outcome.reason) == (Disposition.TERMINALIZE,
                                                     Reason.WORKER_DIED_MID_STEP)
    job = rq_project.job(job_id)
    assert job.get_status().value == "failed"
    result = job.latest_result()
    assert result is not None
    assert "reconciler: worker_died_mid_step" in (result.exc_string or "")
    second = start(processes, rq_project, markers, "worker-b")
    later = rq_project.enqueue(LEDGER_CHARGE)
    wait_status(rq_project, later, "finished", worker=second)
    assert markers.of(job_id) == {"step-fetch-1", "step-charge-1"}


def test_a_run_rq_requeued_by_itself_never_gets_the_started_effectful_step(
        rq_project: RqProject, processes: Processes, markers: Markers) -> None:
    """Killed inside ``charge`` with a ``Retry(max=2)``, and RQ's own cleanup (what a
    successor worker runs first) got there before any pass: it requeued the job under the
    same attempt count (the recipe reads ``reconciler_attempt or 1``). The new worker's run
    is refused ``EffectInDoubt`` by the ledger at every retry RQ makes: ``charge`` never
    runs again, and RQ ends the job failed naming the refusal."""
    from rq.registry import StartedJobRegistry  # noqa: PLC0415

    job_id = rq_project.enqueue(LEDGER_CHARGE, hang="charge", retry=2)
    first = start(processes, rq_project, markers, "worker-a")
    charged = markers.folder / f"{job_id}-step-charge-1"
    wait_until(charged.exists, "charge to start", process=first)
    charged_by = charged.read_text()
    sigkill(first)
    rq_project.expire_as_time_would(job_id, first)
    StartedJobRegistry("default", connection=rq_project.redis()).cleanup()
    assert rq_project.status(job_id) in ("queued", "scheduled")  # RQ's own retry
    second = start(processes, rq_project, markers, "worker-b")
    wait_status(rq_project, job_id, "failed", worker=second)
    job = rq_project.job(job_id)
    assert job.retries_left == 0
    assert "EffectInDoubt" in (job.latest_result().exc_string or "")
    assert charged.read_text() == charged_by
    assert markers.of(job_id) == {"step-fetch-1", "step-charge-1"}
