"""A new user's flow beside Celery, as docs/sources.md tells it: its config pasted (the
database, broker and silence timeout filled in), ``reconciler run``, a prefork worker
SIGKILLed mid-task, the decision as the caller's ``AsyncResult`` reads it, and the console's
job page naming the task and Celery's own status; on SQLite and PostgreSQL."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.test_service import Launcher
from tests.sources.celery_support import CeleryProject, kill_worker
from tests.sources.support import Markers, Processes, wait_until
from tests.sources.test_celery_workers import TIMEOUT_SECONDS, started

DOCS = REPO_ROOT / "docs" / "sources.md"
HEADING = "# reconciler.toml beside a Celery app"


def docs_config(project: CeleryProject) -> str:
    """The Celery config block of the docs, with this test's database, broker and timeout."""
    text = DOCS.read_text(encoding="utf-8")
    block = text[text.index(HEADING):]
    block = block[:block.index("```")]
    for key, value in (("database_url", f'"{project.database_url}"'),
                       ("broker_url", f'"{project.broker_url}"'),
                       ("session_timeout_seconds", str(TIMEOUT_SECONDS))):
        block, found = re.subn(rf"^{key} = \S+", f"{key} = {value}", block, flags=re.M)
        assert found == 1, f"the docs' Celery config has no {key} line"
    return block


def test_the_docs_config_recovers_a_killed_workers_task_and_the_console_shows_it(
        celery_project: CeleryProject, celery_live_worker: str, processes: Processes,
        tmp_path: Path) -> None:
    """(``celery_live_worker``: the rest of the app's fleet, answering ping.)"""
    markers = Markers(tmp_path / "markers")
    settings = tmp_path / "reconciler.toml"
    settings.write_text(docs_config(celery_project))
    result, worker = started(celery_project, processes, markers, "effect.work")
    launcher = Launcher(tmp_path)
    try:
        sidecar = launcher.start(celery_project.database_url, config=settings,
                                 interval_seconds=1, session_heartbeat_seconds=1,
                                 brake_hold_seconds=0, stale_after_seconds=0.5)
        kill_worker(worker)
        wait_until(lambda: celery_project.status(result.id) == "FAILURE",
                   "the killed worker's task decided", timeout=60)
        with pytest.raises(Exception, match="worker_died_mid_step") as raised:
            result.get(timeout=5)
        assert type(raised.value).__name__ == "WorkerLostError"
        status, page = sidecar.get(f"/jobs/celery/{result.id}")
        assert status == 200, page
        assert "effect.work" in page
        assert "FAILURE" in page
        assert "worker_died_mid_step" in page
        assert "worker-a@tests" not in page  # never a worker's name
    finally:
        launcher.close()
