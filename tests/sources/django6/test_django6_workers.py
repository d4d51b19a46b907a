"""A Django 6 project on its own ``django.tasks`` framework with django-tasks-db, on Python
3.12 (a venv of its own), its ``db_worker``s SIGKILLed mid-task and recovered by one
``reconciler pass --config reconciler.toml`` run from the suite's Python, on SQLite and
PostgreSQL.

Django 6's own ``migrate`` creates the backend's table and its own ``enqueue`` the tasks; a
new Django 6 ``db_worker`` finishes the resumed idempotent task, and Django 6's own result
API (``django.tasks``, in a process where this project cannot be imported) reads the
effectful one's failure. A live worker's task is left as it was.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.storage.engines import create_engine
from tests.conftest import PostgresForTests
from tests.helpers import fresh_database
from tests.pg_server import INSTALL_HINT
from tests.sources.conftest import unavailable
from tests.sources.django_tasks_support import DjangoDatabase, DjangoTasksFactory, worker_argv
from tests.sources.support import Markers, Process, Processes, wait_until
from tests.sources.test_one_pass_cli import decided, reconciler_pass

TASKS = "tests.sources.django_app.tasks"
MAX_RUN_SECONDS = 1.0  # the declared run time of the tasks whose workers are killed


@pytest.fixture(params=("sqlite", "postgresql"))
def django6_db(request: pytest.FixtureRequest, tmp_path: Path,
               django6_python: str) -> Iterator[DjangoDatabase]:
    """A database with the reconciler's tables, migrated by Django 6's own ``migrate``."""
    if request.param == "sqlite":
        url = fresh_database(tmp_path)
        name = None
    else:
        postgres: PostgresForTests | None = request.getfixturevalue("postgres")
        if postgres is None:
            unavailable(f"PostgreSQL not available: {INSTALL_HINT}")
        assert postgres is not None  # unavailable() skipped or failed
        name = postgres.new_database(migrated=True)
        url = postgres.url(name)
    engine = create_engine(url)
    db = DjangoDatabase(url, url, engine, python=django6_python)
    try:
        db.manage("migrate", "-v0")
        yield db
    finally:
        engine.dispose()
        if name is not None:
            request.getfixturevalue("postgres").drop(name)


def test_a_django6_project(django6_db: DjangoDatabase, processes: Processes,
                           tmp_path: Path) -> None:
    """Two workers killed mid-task, one pass: the idempotent task resumed and finished by
    the next worker, the effectful one failed as Django 6 reads it, the live one as it was."""
    db = django6_db
    project = DjangoTasksFactory(db)
    markers = Markers(tmp_path / "markers")
    config = tmp_path / "reconciler.toml"
    config.write_text(f"""
database_url = "{db.url}"
stale_after_seconds = 0.5

[source]
kind = "django-tasks"

[kinds."*"]
max_run_seconds = {MAX_RUN_SECONDS}

[kinds."{TASKS}.idem_work"]
effect = "idempotent"

[kinds."{TASKS}.pure_work"]
max_run_seconds = 3600
""")
    env = db.env(markers.folder)

    def enqueue(task: str) -> str:
        return db.manage("enqueue", task, "{}", markers=markers.folder).strip()

    def start(name: str) -> Process:
        return processes.start(name, worker_argv(db.python), env)

    idem, effect = enqueue("idem_work"), enqueue("effect_work")
    doomed = [start(f"doomed-{i}") for i in (1, 2)]
    wait_until(lambda: markers.has(f"{idem}-started-1") and markers.has(f"{effect}-started-1"),
               "both tasks to start", process=doomed[0])
    for worker in doomed:
        worker.kill()
    live_task = enqueue("pure_work")
    live = start("live")
    wait_until(lambda: markers.has(f"{live_task}-started-1"), "the live task to start",
               process=live)
    live_row = project.row(live_task)
    time.sleep(MAX_RUN_SECONDS + 0.2)  # past the killed tasks' declared max_run_seconds

    report = reconciler_pass(config)

    assert decided(report) == {idem: "resumed_idempotent_step",
                               effect: "worker_died_mid_step"}
    start("next")
    wait_until(lambda: project.status(idem) == "completed", "the next worker to finish it")
    assert markers.of(idem) == {"started-1", "started-2", "done-2"}
    finished = json.loads(db.manage("result", idem))
    assert (finished["framework"], finished["status"], finished["attempts"],
            finished["return_value"]) == ("django.tasks", "SUCCESSFUL", 2, "done on attempt 2")
    failed = json.loads(db.manage("result", effect))
    assert (failed["framework"], failed["status"], failed["finished"]) == (
        "django.tasks", "FAILED", True)
    assert failed["errors"][-1]["exception_class"] == "builtins.RuntimeError"
    assert failed["errors"][-1]["traceback"].strip().splitlines()[-1] == (
        "RuntimeError: worker_died_mid_step")
    assert markers.of(effect) == {"started-1"}  # never run again
    assert project.row(live_task) == live_row
    assert live.alive()
