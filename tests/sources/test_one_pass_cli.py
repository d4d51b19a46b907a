"""A Django project, a Celery app and a Procrastinate app, each with workers SIGKILLed
mid-task, recovered by ``reconciler pass --config reconciler.toml`` (Django and Celery on
SQLite and PostgreSQL, Procrastinate on PostgreSQL): the idempotent task finished by the
system's own next worker, the effectful one failed with ``worker_died_mid_step`` as the
system's own API reads it, a live worker's task untouched.

``TESTS_SIDECAR_PYTHON`` names the interpreter the pass runs in (default: this
one): another virtualenv's, holding only the project and a source's extra, shows that
extra is all the sidecar needs beside the system's workers (docs/sources.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import REPO_ROOT
from tests.sources.celery_support import CeleryProject, kill_worker
from tests.sources.celery_support import worker_argv as celery_worker
from tests.sources.conftest import SourcesDatabase
from tests.sources.django_tasks_support import DjangoTasksFactory
from tests.sources.django_tasks_support import worker_argv as django_worker
from tests.sources.factories import ProcrastinateFactory
from tests.sources.support import Markers, Process, Processes, wait_until

TASKS = "tests.sources.django_app.tasks"
SIDECAR_PYTHON = os.environ.get("TESTS_SIDECAR_PYTHON") or sys.executable


def reconciler_pass(config: Path) -> dict[str, Any]:
    """``reconciler pass --config PATH --json``, as an operator runs it."""
    done = subprocess.run([SIDECAR_PYTHON, "-m", "reconciler.cli", "pass", "--config",
                           str(config), "--json"], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT, check=False)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def decided(report: dict[str, Any]) -> dict[str, str]:
    return {str(d["job_id"]): d["reason"] for d in report["decisions"]}


def test_a_django_project(django_db: Any, processes: Processes, tmp_path: Path) -> None:
    project = DjangoTasksFactory(django_db)
    markers = Markers(tmp_path / "markers")
    config = tmp_path / "reconciler.toml"
    config.write_text(f"""
database_url = "{django_db.url}"
stale_after_seconds = 0.5

[source]
kind = "django-tasks"

[kinds."*"]
max_run_seconds = 1

[kinds."{TASKS}.idem_work"]
effect = "idempotent"
max_run_seconds = 1

[kinds."{TASKS}.ledger_charge"]
max_run_seconds = 3600
""")
    env = django_db.env(markers.folder)

    def enqueue(task: str, **kwargs: Any) -> str:
        return str(django_db.manage("enqueue", task, json.dumps(kwargs),
                                    markers=markers.folder).strip())

    idem, effect = enqueue("idem_work"), enqueue("effect_work")
    doomed = [processes.start(f"doomed-{i}", django_worker(), env) for i in (1, 2)]
    wait_until(lambda: {project.status(idem), project.status(effect)} == {"running"},
               "both tasks to start", process=doomed[0])
    for worker in doomed:
        worker.kill()
    live_task = enqueue("ledger_charge", hang_after="fetch")
    live = processes.start("live", django_worker(), env)
    wait_until(lambda: markers.has(f"{live_task}-step-fetch-1"), "the live task to run",
               process=live)
    time.sleep(1.2)  # past the killed tasks' declared max_run_seconds

    report = reconciler_pass(config)

    assert decided(report) == {idem: "resumed_idempotent_step",
                               effect: "worker_died_mid_step"}
    processes.start("next", django_worker(), env)
    wait_until(lambda: project.status(idem) == "completed", "the next worker to finish it")
    result = json.loads(django_db.manage("result", effect))
    assert result["status"] == "FAILED"
    assert result["errors"][0]["traceback"].strip().endswith("worker_died_mid_step")
    assert project.status(live_task) == "running"
    assert live.alive()


def test_a_celery_app(celery_project: CeleryProject, processes: Processes,
                      tmp_path: Path) -> None:
    markers = Markers(tmp_path / "markers")
    config = tmp_path / "reconciler.toml"
    config.write_text(f"""
database_url = "{celery_project.database_url}"
stale_after_seconds = 0.5
session_timeout_seconds = 2
session_heartbeat_seconds = 0.5

[source]
kind = "celery"
broker_url = "{celery_project.broker_url}"

[kinds."idem.*"]
effect = "idempotent"
""")
    env = celery_project.env(markers.folder)
    caller = celery_project.caller()
    started: dict[str, Any] = {}
    for name, queue in (("idem.work", "q1"), ("effect.work", "q2"), ("idem.work", "q3")):
        started[queue] = caller.send_task(name, queue=queue)
    workers = {q: processes.start(q, celery_worker(f"w-{q}", queues=q), env)
               for q in ("q1", "q2", "q3")}
    for queue, result in started.items():
        wait_until(lambda r=result: markers.has(f"{r.id}-started-1"), f"the task on {queue}",
                   process=workers[queue])
    for queue in ("q1", "q2"):
        kill_worker(workers[queue])

    first = reconciler_pass(config)  # finds them silent: silence is measured across passes
    assert first["decisions"] == []
    time.sleep(2.2)  # past session_timeout_seconds of silence
    report = reconciler_pass(config)

    idem, effect, live = (started[q] for q in ("q1", "q2", "q3"))
    assert decided(report) == {idem.id: "resumed_idempotent_step",
                               effect.id: "worker_died_mid_step"}
    processes.start("next", celery_worker("next", queues="q1,q2"), env)
    assert idem.get(timeout=60) == "done on attempt 2"
    try:
        effect.get(timeout=5)
        raised = ""
    except Exception as failed:
        raised = f"{type(failed).__name__}: {failed}"
    assert raised.startswith("WorkerLostError: worker_died_mid_step")
    assert celery_project.status(live.id) == "STARTED"
    assert workers["q3"].alive()


def test_a_procrastinate_app(procrastinate_db: SourcesDatabase, procrastinate_schema: str,
                             processes: Processes, tmp_path: Path) -> None:
    factory = ProcrastinateFactory(procrastinate_db, procrastinate_schema)
    markers = Markers(tmp_path / "markers")
    config = tmp_path / "reconciler.toml"
    config.write_text(f"""
database_url = "{procrastinate_db.url}"
session_timeout_seconds = 2
session_heartbeat_seconds = 0.5

[source]
kind = "procrastinate"
schema = "{procrastinate_schema}"

[kinds."idem.*"]
effect = "idempotent"
""")
    env = {"SOURCES_PG_CONNINFO": procrastinate_db.conninfo(f"{procrastinate_schema},public"),
           "SOURCES_MARKERS": str(markers.folder), "SOURCES_DATABASE_URL": procrastinate_db.url}

    def worker(name: str) -> Process:
        return processes.start(name, [sys.executable, "-m", "tests.sources.procrastinate_app"],
                               env, cwd=REPO_ROOT)

    idem, effect = factory.defer("idem.work"), factory.defer("effect.work")
    doomed = [worker(f"doomed-{i}") for i in (1, 2)]
    wait_until(lambda: markers.has(f"{idem}-started-0") and markers.has(f"{effect}-started-0"),
               "both jobs to start", process=doomed[0])
    for process in doomed:
        process.kill()
    live_job = factory.defer("pure.work")
    live = worker("live")
    wait_until(lambda: markers.has(f"{live_job}-started-0"), "the live job to start",
               process=live)
    time.sleep(2.2)  # past session_timeout_seconds of the killed workers' silence

    report = reconciler_pass(config)

    assert decided(report) == {str(idem): "resumed_idempotent_step",
                               str(effect): "worker_died_mid_step"}
    worker("next")
    wait_until(lambda: factory.status(idem) == "completed", "the next worker to finish it")
    assert factory.status(effect) == "failed"
    assert factory.events(effect)[-1] == "failed"
    assert factory.status(live_job) == "running"
    assert live.alive()
