"""The celery source re-publishes a resumed task before its pass commits: a replica killed
between the two has sent the message already, its ``RETRY`` row never lands, and the task
runs again on the next worker. The other order would lose it: a ``RETRY`` row committed
with no message, which nothing would ever run (docs/sources.md, Celery: publish, then
commit). A real worker, a real Redis, and a real ``reconciler pass`` process SIGKILLed by
the ``between_apply_and_record`` failpoint, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.vocabulary import Disposition, EffectKind
from reconciler.sources.celery import CeleryConfig
from tests.sources.celery_support import CeleryProject, kill_worker, worker_argv
from tests.sources.support import Markers, Process, Processes, reconcile_once, wait_until

REPO = Path(__file__).parents[2]
TIMEOUT_SECONDS = 2.0
KINDS = KindRules([KindRule("idem.*", effect=EffectKind.IDEMPOTENT)],
                  stale_after_seconds=0.5, wedged_after_seconds=3600.0, max_attempts=3)
CONFIG = """\
database_url = {database_url}
session_timeout_seconds = {timeout}
session_heartbeat_seconds = 0.3
stale_after_seconds = 0.5
wedged_after_seconds = 3600.0
default_max_attempts = 3
brake_hold_seconds = 0.0

[source]
kind = "celery"
broker_url = {broker_url}

[kinds."idem.*"]
effect = "idempotent"
"""


def start_worker(processes: Processes, project: CeleryProject, markers: Markers,
                 name: str) -> Process:
    return processes.start(name, worker_argv(name), project.env(markers.folder), cwd=REPO)


def queued_task_ids(broker_url: str) -> list[str]:
    """The ids of the messages waiting on Celery's default queue."""
    import redis  # noqa: PLC0415 - present: the celery fixtures checked

    raw = redis.Redis.from_url(broker_url).lrange("celery", 0, -1)
    return [json.loads(message)["headers"]["id"] for message in raw]


def would_resume(project: CeleryProject, task_id: str) -> bool:
    """A dry run (it records the worker's silence in the broker, changes nothing) plans the
    task's resume: its worker is gone."""
    config = CeleryConfig(broker_url=project.broker_url,
                          session_timeout_seconds=TIMEOUT_SECONDS)
    return any(o.job_id == task_id and o.disposition is Disposition.RESUME
               for o in reconcile_once(project.engine, config, KINDS, dry_run=True))


def test_a_pass_killed_after_the_publish_and_before_its_commit_loses_no_task(
        celery_project: CeleryProject, processes: Processes, tmp_path: Path,
        celery_live_worker: str) -> None:
    """(``celery_live_worker``: another worker of the app answers ping, so the killed one's
    silence is evidence.)"""
    markers = Markers(tmp_path / "markers")
    result = celery_project.caller().send_task("idem.work")
    first = start_worker(processes, celery_project, markers, "worker-a")
    wait_until(lambda: markers.has(f"{result.id}-started-1"), "the task to start",
               process=first)
    kill_worker(first)
    wait_until(lambda: would_resume(celery_project, result.id), "its worker to be gone")
    config = tmp_path / "reconciler.toml"
    config.write_text(CONFIG.format(database_url=json.dumps(celery_project.database_url),
                                    broker_url=json.dumps(celery_project.broker_url),
                                    timeout=TIMEOUT_SECONDS))

    killed = subprocess.run(
        [sys.executable, "-m", "reconciler.cli", "pass", "--config", str(config)],
        env={**os.environ, "RECONCILER_FAILPOINTS": "between_apply_and_record"}, cwd=REPO,
        capture_output=True, text=True, timeout=120, check=False)

    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert celery_project.status(result.id) == "STARTED"  # the pass never committed
    assert queued_task_ids(celery_project.broker_url) == [result.id]  # the message is out
    start_worker(processes, celery_project, markers, "worker-b")
    assert result.get(timeout=30) == "done on attempt 2"
    assert markers.of(result.id) == {"started-1", "started-2", "done-2"}


@pytest.fixture(autouse=True)
def _no_failpoints_here() -> None:
    """The failpoint is the pass process's own; this process never hits one."""
    assert "RECONCILER_FAILPOINTS" not in os.environ
