"""Real Celery workers over a real Redis, SIGKILLed mid-task, recovered by the celery source
on SQLite and PostgreSQL (Celery's database result backend on the reconciler's database;
``TestDjangoCeleryResults``: django-celery-results' table in a Django project instead).

The caller's own ``AsyncResult`` sees every recovery: a resumed task completes on a new
worker of the app, a failed one raises at once. Workers answer ping through the broker; the
source judges one gone after 2 s of silence across passes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.vocabulary import Disposition, EffectKind, Reason, StuckReason
from reconciler.root.cli import assemble_cli
from reconciler.sources.celery import CeleryConfig
from reconciler.sources.celery.broker import CeleryBroker
from tests.cli_runner import run_main
from tests.sources.celery_support import (
    CeleryProject,
    kill_worker,
    worker_argv,
    worker_tree,
)
from tests.sources.support import (
    PASS_GAP_SECONDS,
    RECOVERY_POLL_SECONDS,
    Markers,
    Outcome,
    Process,
    Processes,
    config_for,
    reconcile_once,
    record_finding,
    wait_until,
)
from tests.sources.test_one_pass_cli import reconciler_pass

TIMEOUT_SECONDS = 2.0
VISIBILITY_SECONDS = 2.0  # the broker's redelivery delay under task_acks_late
KINDS = KindRules([KindRule("idem.*", effect=EffectKind.IDEMPOTENT)],
                  stale_after_seconds=0.5, wedged_after_seconds=3600.0, max_attempts=3)


@pytest.fixture(autouse=True)
def surviving_worker(celery_live_worker: str) -> str:
    """Another worker of the app, answering ping: silence is evidence of death only where
    some worker answers (else nothing that depends on ping is decided)."""
    return celery_live_worker


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def config(project: CeleryProject, broker_url: str | None = None) -> CeleryConfig:
    return CeleryConfig(broker_url=broker_url or project.broker_url,
                        result_table=project.table, session_timeout_seconds=TIMEOUT_SECONDS)


def start_worker(processes: Processes, project: CeleryProject, markers: Markers, name: str,
                 *, pool: str = "prefork", **env: str) -> Process:
    return processes.start(name, worker_argv(name, pool),
                           {**project.env(markers.folder), **env},
                           cwd=Path(__file__).parents[2])


def recover(project: CeleryProject, task_id: str, worker: Process,
            kinds: KindRules = KINDS) -> Outcome:
    """Passes until one changes the task (its worker silent past the timeout)."""
    def decided() -> Outcome | None:
        for outcome in reconcile_once(project.engine, config(project), kinds):
            if outcome.job_id == task_id and outcome.applied:
                return outcome
        return None

    outcome: Outcome = wait_until(decided, f"a decision on task {task_id}", timeout=30,
                                  process=worker, every=RECOVERY_POLL_SECONDS)
    return outcome


def send(project: CeleryProject, name: str, **kwargs: Any) -> Any:
    """``send_task`` from the caller's app; its AsyncResult."""
    return project.caller().send_task(name, kwargs=kwargs)


def started(project: CeleryProject, processes: Processes, markers: Markers, task: str,
            worker: str = "worker-a") -> tuple[Any, Process]:
    """``task`` sent, and started by a new prefork worker: its AsyncResult and the worker."""
    result = send(project, task)
    process = start_worker(processes, project, markers, worker)
    wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
               process=process)
    return result, process


class TestKilledWorker:
    """A whole prefork worker SIGKILLed mid-task: the row would stay STARTED for ever."""

    def test_idempotent_task_is_republished_and_the_callers_result_completes(
            self, celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        result = send(celery_project, "idem.work")
        first = start_worker(processes, celery_project, markers, "worker-a")
        wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
                   process=first)
        kill_worker(first)
        killed_at = time.monotonic()
        held = CeleryBroker(celery_project.broker_url).unacked([result.id])
        outcome = recover(celery_project, result.id, first)
        decided_after = time.monotonic() - killed_at
        assert (outcome.disposition, outcome.reason) == (Disposition.RESUME,
                                                         Reason.RESUMED_IDEMPOTENT_STEP)
        assert celery_project.status(result.id) == "RETRY"
        second = start_worker(processes, celery_project, markers, "worker-b")
        assert result.get(timeout=30) == "done on attempt 2"
        assert markers.of(result.id) == {"started-1", "started-2", "done-2"}
        record_finding("celery", "killed_worker_recovered", job_id=result.id,
                       engine=celery_project.engine.dialect.name,
                       decided_seconds_after_kill=round(decided_after, 2),
                       acks_late=False, broker_held_the_message=bool(held),
                       retries=result.retries, worker_alive=second.alive())

    def test_effectful_task_fails_at_once_for_the_caller_and_never_runs_again(
            self, celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        result = send(celery_project, "effect.work")
        first = start_worker(processes, celery_project, markers, "worker-a")
        wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
                   process=first)
        kill_worker(first)
        outcome = recover(celery_project, result.id, first)
        assert outcome.reason is Reason.WORKER_DIED_MID_STEP
        with pytest.raises(Exception, match="worker_died_mid_step") as raised:
            result.get(timeout=5)
        assert type(raised.value).__name__ == "WorkerLostError"
        second = start_worker(processes, celery_project, markers, "worker-b")
        later = send(celery_project, "idem.work", hang=[])
        assert later.get(timeout=30) == "done on attempt 1"
        assert markers.of(result.id) == {"started-1"}
        assert second.alive()

    def test_steps_recorded_in_the_ledger_resume_at_the_first_unstarted_step(
            self, celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        result = send(celery_project, "ledger.charge", hang_after="fetch")
        first = start_worker(processes, celery_project, markers, "worker-a")
        wait_until(lambda: markers.has(f"{result.id}-step-fetch-1"), "fetch to run",
                   process=first)
        time.sleep(0.2)  # fetch's success is recorded as its block ends
        kill_worker(first)
        outcome = recover(celery_project, result.id, first)
        assert (outcome.reason, outcome.resume_step_index) == (
            Reason.RESUMED_FROM_UNSTARTED_STEP, 1)
        start_worker(processes, celery_project, markers, "worker-b")
        assert result.get(timeout=30) == "charged"
        assert markers.of(result.id) == {"pending-1-0,1,2", "step-fetch-1", "pending-2-1,2",
                                         "step-charge-2", "step-notify-2", "done-2"}


class TestBrokerRedelivery:
    """task_acks_late: the killed worker's message stays unacknowledged in Redis, and the
    broker would run it again after visibility_timeout by itself."""

    def test_without_the_reconciler_the_broker_runs_it_again_by_itself(
            self, celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        """The control: kombu puts the killed run's message back after visibility_timeout
        and a worker runs the task a second time (why the source must take it out)."""
        late = {"SOURCES_ACKS_LATE": "1", "SOURCES_VISIBILITY_TIMEOUT": str(VISIBILITY_SECONDS)}
        result = send(celery_project, "effect.work", hang=[3.0])
        first = start_worker(processes, celery_project, markers, "worker-a", **late)
        wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
                   process=first)
        (markers.folder / f"{result.id}-started-1").unlink()
        kill_worker(first)
        start_worker(processes, celery_project, markers, "worker-b", **late)
        time.sleep(VISIBILITY_SECONDS)  # the message is older than the timeout
        celery_project.restore_unacked(VISIBILITY_SECONDS)
        wait_until(lambda: markers.has(f"{result.id}-done-1"), "the broker's redelivery",
                   process=first)
        record_finding("celery", "acks_late_redelivered_without_reconciler",
                       job_id=result.id, engine=celery_project.engine.dialect.name,
                       ran_again=markers.has(f"{result.id}-started-1"))
        assert markers.has(f"{result.id}-started-1")

    def test_a_failed_effectful_task_is_taken_out_of_the_broker(
            self, celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        late = {"SOURCES_ACKS_LATE": "1", "SOURCES_VISIBILITY_TIMEOUT": str(VISIBILITY_SECONDS)}
        result = send(celery_project, "effect.work")
        first = start_worker(processes, celery_project, markers, "worker-a", **late)
        wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
                   process=first)
        kill_worker(first)
        broker = CeleryBroker(celery_project.broker_url)
        held = broker.unacked([result.id])
        assert held, "with task_acks_late the broker keeps the killed run's message"
        outcome = recover(celery_project, result.id, first)
        assert outcome.reason is Reason.WORKER_DIED_MID_STEP
        assert broker.unacked([result.id]) == {}
        record_finding("celery", "acks_late_killed_worker", job_id=result.id,
                       engine=celery_project.engine.dialect.name, broker_held_the_message=True,
                       held_after_terminalize=False)
        second = start_worker(processes, celery_project, markers, "worker-b", **late)
        celery_project.restore_unacked(VISIBILITY_SECONDS)  # nothing left to put back
        later = send(celery_project, "idem.work", hang=[2.0])
        assert later.get(timeout=30) == "done on attempt 1"
        assert markers.of(result.id) == {"started-1"}
        assert celery_project.status(result.id) == "FAILURE"
        assert second.alive()

    def test_a_resumed_task_runs_once_more_not_twice(
            self, celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        late = {"SOURCES_ACKS_LATE": "1", "SOURCES_VISIBILITY_TIMEOUT": str(VISIBILITY_SECONDS)}
        result = send(celery_project, "idem.work")
        first = start_worker(processes, celery_project, markers, "worker-a", **late)
        wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
                   process=first)
        kill_worker(first)
        recover(celery_project, result.id, first)
        start_worker(processes, celery_project, markers, "worker-b", **late)
        celery_project.restore_unacked(VISIBILITY_SECONDS)  # nothing left to put back
        assert result.get(timeout=30) == "done on attempt 2"
        later = send(celery_project, "idem.work", hang=[2.0])
        assert later.get(timeout=30) == "done on attempt 1"
        assert markers.of(result.id) == {"started-1", "started-2", "done-2"}


class TestLiveWorkers:
    """Silence is not death: what the source leaves alone."""

    def test_a_prefork_workers_running_task_is_never_touched(
            self, celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        """Its parent answers ping while the pool process works."""
        result = send(celery_project, "idem.work")
        worker = start_worker(processes, celery_project, markers, "worker-a")
        wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
                   process=worker)
        before = celery_project.row(result.id)
        deadline = time.monotonic() + TIMEOUT_SECONDS + 1.5
        while time.monotonic() < deadline:
            assert reconcile_once(celery_project.engine, config(celery_project), KINDS) == []
            time.sleep(PASS_GAP_SECONDS)
        assert celery_project.row(result.id) == before
        assert worker.alive()

    def test_a_busy_solo_worker_is_silent_but_its_kinds_max_run_seconds_protects_it(
            self, celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        """A solo pool does not answer ping while it runs a task: only a declared
        max_run_seconds (from when the reconciler first saw the row) keeps it."""
        kinds = KindRules([KindRule("idem.*", effect=EffectKind.IDEMPOTENT,
                                    max_run_seconds=3600.0)],
                          stale_after_seconds=0.5, wedged_after_seconds=3600.0,
                          max_attempts=3)
        result = send(celery_project, "idem.work")
        worker = start_worker(processes, celery_project, markers, "worker-a", pool="solo")
        wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
                   process=worker)
        deadline = time.monotonic() + TIMEOUT_SECONDS + 1.5
        while time.monotonic() < deadline:
            assert reconcile_once(celery_project.engine, config(celery_project), kinds) == []
            time.sleep(PASS_GAP_SECONDS)
        assert celery_project.status(result.id) == "STARTED"
        assert worker.alive()

    def test_no_broker_answer_decides_nothing(
            self, celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        """A dead worker's task, judged through a broker that cannot be reached: left."""
        result = send(celery_project, "idem.work")
        first = start_worker(processes, celery_project, markers, "worker-a")
        wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
                   process=first)
        kill_worker(first)
        unreachable = config(celery_project, "redis://127.0.0.1:1/0")
        deadline = time.monotonic() + TIMEOUT_SECONDS + 1.5
        while time.monotonic() < deadline:
            assert reconcile_once(celery_project.engine, unreachable, KINDS) == []
            time.sleep(PASS_GAP_SECONDS)
        assert celery_project.status(result.id) == "STARTED"


class TestLateWriter:
    """The whole worker SIGSTOPped past the timeout, its task failed, then SIGCONTed."""

    def test_a_late_worker_overwrites_the_failure(
            self, celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        """Celery's database backend refuses only to overwrite a SUCCESS: the old run's
        success replaces our FAILURE (the caller's get() had raised already)."""
        result = send(celery_project, "effect.work", hang=[4.0])
        old = start_worker(processes, celery_project, markers, "worker-old")
        wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
                   process=old)
        stopped = worker_tree(old)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        outcome = recover(celery_project, result.id, old)
        assert outcome.reason is Reason.WORKER_DIED_MID_STEP
        with pytest.raises(Exception, match="worker_died_mid_step"):
            result.get(timeout=5)
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: celery_project.status(result.id) != "FAILURE",
                   "the old worker's late write", process=old)
        after = celery_project.status(result.id)
        record_finding("celery", "late_writer", job_id=result.id,
                       engine=celery_project.engine.dialect.name, status_after=after,
                       markers=sorted(markers.of(result.id)))
        assert after == "SUCCESS"



def test_rows_written_without_result_extended_are_left_alone_and_said_once(
        celery_project: CeleryProject, caplog: pytest.LogCaptureFixture) -> None:
    """A STARTED row without a task name (the app lacks result_extended): no decision, the
    row as it was, and one warning naming the missing setting."""
    import json  # noqa: PLC0415

    import sqlalchemy as sa  # noqa: PLC0415
    from celery.backends.database.models import Task as TaskRow  # noqa: PLC0415

    from reconciler.sources.celery import liveness as celery_liveness  # noqa: PLC0415

    celery_liveness._WARNED.clear()
    with celery_project.engine.begin() as conn:
        conn.execute(sa.insert(TaskRow.__table__).values(
            task_id="plain-1", status="STARTED",
            result=json.dumps({"pid": 1, "hostname": "gone@tests"}).encode()))
    before = celery_project.row("plain-1")
    with caplog.at_level("WARNING", logger="reconciler.sources.celery"):
        for _ in range(2):
            assert reconcile_once(celery_project.engine, config(celery_project), KINDS) == []
    assert celery_project.row("plain-1") == before
    # Never decided, so stuck for good: the gauges count it, under its own reason.
    passes = assemble_cli(config_for(celery_project.engine, config(celery_project), KINDS),
                          engine=celery_project.engine).passes
    assert passes.stuck_work()[StuckReason.UNDECIDABLE].count == 1
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "missing_setting=result_extended" in warnings[0]


ECHO_ARGS = [1, "two", {"3": [4.5, None, True]}, "é 'quoted'"]
ECHO_KWARGS = {"note": "ünïcode", "nested": {"k": [1, 2]}}


class TestDjangoCeleryResults:
    """The same Celery app with ``result_backend = "django-db"``: django-celery-results'
    table (no retry count, no queue, the arguments as a repr) in a Django project, its
    workers SIGKILLed mid-task, one ``reconciler pass --config`` as an operator runs it,
    and what the caller's ``AsyncResult`` reads through django-celery-results after."""

    def test_one_pass_resumes_fails_and_leaves_the_live_workers_task(
            self, django_celery_project: CeleryProject, processes: Processes,
            markers: Markers, tmp_path: Path) -> None:
        project = django_celery_project
        toml = tmp_path / "reconciler.toml"
        toml.write_text(f"""
database_url = "{project.database_url}"
stale_after_seconds = 0.5
session_timeout_seconds = 2
session_heartbeat_seconds = 0.5

[source]
kind = "celery"
broker_url = "{project.broker_url}"
result_table = "django_celery_results_taskresult"
task_routes = {{ "idem.*" = "q1" }}
task_default_queue = "q2"

[kinds."idem.*"]
effect = "idempotent"
""")
        caller = project.caller()
        started = {"q1": caller.send_task("idem.echo", args=ECHO_ARGS,
                                          kwargs=ECHO_KWARGS, queue="q1"),
                   "q2": caller.send_task("effect.work", queue="q2"),
                   "q3": caller.send_task("idem.work", queue="q3")}
        env = project.env(markers.folder)
        workers = {q: processes.start(q, worker_argv(f"w-{q}", queues=q), env,
                                      cwd=Path(__file__).parents[2])
                   for q in ("q1", "q2", "q3")}
        for queue, sent in started.items():
            wait_until(lambda r=sent: markers.has(f"{r.id}-started-1"),
                       f"the task on {queue}", process=workers[queue])
        for queue in ("q1", "q2"):
            kill_worker(workers[queue])
        idem, effect, live = (started[q].id for q in ("q1", "q2", "q3"))
        before = project.row(live)

        assert reconciler_pass(toml)["decisions"] == []  # silence is measured across passes
        time.sleep(TIMEOUT_SECONDS + 0.2)
        report = reconciler_pass(toml)

        assert {str(d["job_id"]): d["reason"] for d in report["decisions"]} == {
            idem: "resumed_idempotent_step", effect: "worker_died_mid_step"}
        assert project.status(idem) == "RETRY"
        processes.start("next", worker_argv("next", queues="q1,q2"), env,
                        cwd=Path(__file__).parents[2])
        assert project.result(idem, 60) == {"value": [ECHO_ARGS, ECHO_KWARGS],
                                            "state": "SUCCESS"}
        failed = project.result(effect, 5)
        assert failed["raised"].startswith("WorkerLostError: worker_died_mid_step")
        assert failed["state"] == "FAILURE"
        assert markers.of(idem) == {"started-1", "started-2", "done-2"}
        assert markers.of(effect) == {"started-1"}
        assert project.row(live) == before
        assert workers["q3"].alive()
        done = run_main(["jobs", "list", "--config", str(toml), "--json"], timeout=120)
        assert done.returncode == 0, done.stderr
        listed = done.stdout
        assert {j["job_id"]: (j["status"], j["reason"]) for j in json.loads(listed)} == {
            idem: ("completed", None), effect: ("failed", "worker_died_mid_step"),
            live: ("processing", None)}
        assert "w-q" not in listed  # no worker's hostname in a public view
        record_finding("celery", "django_celery_results_one_pass",
                       engine=project.engine.dialect.name, resumed=idem, failed=effect)

    @pytest.mark.parametrize("argument", ["x" * 2000, "C:\\new\\table"],
                             ids=["cut-past-argsrepr_maxsize", "backslashes"])
    def test_arguments_the_table_does_not_hold_make_the_task_unresumable(
            self, django_celery_project: CeleryProject, processes: Processes,
            markers: Markers, argument: str) -> None:
        """The stored repr is cut past argsrepr_maxsize, or written unescaped (Celery's
        saferepr): re-publishing it would run the task with other arguments, so the
        idempotent task fails for the caller instead."""
        project = django_celery_project
        sent = project.caller().send_task("idem.echo", args=[argument])
        first = start_worker(processes, project, markers, "worker-a")
        wait_until(lambda: markers.has(f"{sent.id}-started-1"), "the task to start",
                   process=first)
        kill_worker(first)
        outcome = recover(project, sent.id, first)
        assert (outcome.disposition, outcome.reason) == (Disposition.TERMINALIZE,
                                                         Reason.UNRESUMABLE_PLAN)
        assert project.result(sent.id, 5)["raised"].startswith(
            "WorkerLostError: unresumable_plan")
        start_worker(processes, project, markers, "worker-b")
        later = project.caller().send_task("idem.work", kwargs={"hang": []})
        assert project.result(later.id, 30)["value"] == "done on attempt 1"
        assert markers.of(sent.id) == {"started-1"}

    def test_a_task_lost_twice_counts_its_attempts_from_the_audit(
            self, django_celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        """The table keeps no retry count: the second loss is the second attempt, and the
        re-published run is told so (``request.retries``)."""
        project = django_celery_project
        sent = project.caller().send_task("idem.work", kwargs={"hang": [3600, 3600, 0]})
        for attempt, name in ((1, "worker-a"), (2, "worker-b")):
            worker = start_worker(processes, project, markers, name)
            wait_until(lambda a=attempt: markers.has(f"{sent.id}-started-{a}"),
                       f"attempt {attempt} to start", process=worker)
            kill_worker(worker)
            outcome = recover(project, sent.id, worker)
            assert outcome.reason is Reason.RESUMED_IDEMPOTENT_STEP
            assert outcome.evidence["attempts_used"] == attempt
        start_worker(processes, project, markers, "worker-c")
        assert project.result(sent.id, 60)["value"] == "done on attempt 3"

    def test_a_late_worker_overwrites_the_failure(
            self, django_celery_project: CeleryProject, processes: Processes,
            markers: Markers) -> None:
        """django-celery-results saves every field of every write, unguarded: the stopped
        run's success replaces our FAILURE (the caller's get() had raised already)."""
        project = django_celery_project
        sent = project.caller().send_task("effect.work", kwargs={"hang": [4.0]})
        old = start_worker(processes, project, markers, "worker-old")
        wait_until(lambda: markers.has(f"{sent.id}-started-1"), "the task to start",
                   process=old)
        stopped = worker_tree(old)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        outcome = recover(project, sent.id, old)
        assert outcome.reason is Reason.WORKER_DIED_MID_STEP
        assert project.result(sent.id, 5)["raised"].startswith(
            "WorkerLostError: worker_died_mid_step")
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: project.status(sent.id) != "FAILURE",
                   "the old worker's late write", process=old)
        record_finding("celery", "django_celery_results_late_writer", job_id=sent.id,
                       engine=project.engine.dialect.name, status_after=project.status(sent.id))
        assert project.status(sent.id) == "SUCCESS"
