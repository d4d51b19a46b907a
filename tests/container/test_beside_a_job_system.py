"""The image run as ops/kubernetes/beside-a-job-system.yaml runs it, beside a real job
system: the ConfigMap's ``reconciler.toml`` (its ``[source]`` the docs' Django tasks one)
mounted where ``RECONCILER_CONFIG`` points, the Secret's files mounted where the config
reads them, a read-only root as UID 10001, ``db upgrade`` as the Job runs it, then
``reconciler run``. On the host, a real django-tasks-db ``db_worker`` is SIGKILLed mid-task;
the container decides the task from the system's own table.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from reconciler.storage.engines import create_engine
from tests.container import podman_cli
from tests.container.test_image import (
    IMAGE_UID,
    _free_port,
    _wait,
    container_name,
    container_run,
    empty_postgres_url,
)
from tests.sources import conftest as _sources  # noqa: F401 - first, as pytest loads it
from tests.sources.django_tasks_support import DjangoDatabase, require_django, worker_argv
from tests.sources.support import Markers, Processes
from tests.unit.test_kubernetes_manifests import SECRETS, configmap_toml, docs_sources

pytestmark = pytest.mark.container

__all__ = ["container_name", "empty_postgres_url"]  # the fixtures, found by name

CONFIG_DIR = "/etc/stale-claim-reconciler"
INSTANCE = "sidecar-beside-django-tasks"
TASKS = "tests.sources.django_app.tasks"
# The app's [kinds] in the ConfigMap's place: a killed task is decided once its declared
# longest run has passed.
KINDS = f"""
[kinds."{TASKS}.*"]
effect = "effectful"
max_run_seconds = 1
"""


def _mounted_config(folder: Path) -> Path:
    """The ConfigMap's reconciler.toml with the docs' Django tasks [source], readable by
    the image's user (a ConfigMap's files are world-readable)."""
    text = configmap_toml()
    head = text[:text.index("[source]\n")]
    path = folder / "config" / "reconciler.toml"
    path.parent.mkdir()
    path.write_text(head + docs_sources()["django-tasks"] + KINDS)
    path.parent.chmod(0o755)
    path.chmod(0o644)
    return path


def _secrets(folder: Path, database_url: str) -> Path:
    """The Secret's files, one line each, readable by the image's user only (the
    manifest's ``defaultMode: 0440`` with the pod's group)."""
    secrets = folder / "secrets"
    secrets.mkdir()
    (secrets / "database-url").write_text(database_url + "\n")
    (secrets / "console-operators").write_text("alice 0123456789abcdef0123\n")
    for path in (secrets, *secrets.iterdir()):
        os.chown(path, IMAGE_UID, IMAGE_UID)
        path.chmod(0o500 if path.is_dir() else 0o400)
    return secrets


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:  # noqa: S310 - local test
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_the_kubernetes_example_decides_a_killed_django_tasks_worker_from_the_container(
        image: str, empty_postgres_url: str, container_name: str, tmp_path: Path) -> None:
    require_django()
    engine = create_engine(empty_postgres_url)
    url = engine.url
    libpq = f"postgresql://{url.username}@{url.host}:{url.port}/{url.database}"
    project = DjangoDatabase(empty_postgres_url, libpq, engine)
    project.manage("migrate", "-v0")  # the app's own tables, as its deploy makes them
    config = _mounted_config(tmp_path)
    secrets = _secrets(tmp_path, empty_postgres_url)
    port = _free_port()
    common = ["--network", "host", "--read-only", "--read-only-tmpfs=false",
              "-v", f"{config.parent}:{CONFIG_DIR}:ro", "-v", f"{secrets}:{SECRETS}:ro",
              "-e", f"RECONCILER_CONFIG={CONFIG_DIR}/{config.name}"]
    upgraded = container_run(*common, image, "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    assert "created this project's schema" in upgraded.stdout
    podman_cli.podman("run", "--detach", "--name", container_name, *podman_cli.run_flags(),
                      "--health-interval", "disable", *common,
                      "-e", f"RECONCILER_METRICS_PORT={port}",
                      "-e", "RECONCILER_INTERVAL_SECONDS=1",
                      "-e", f"RECONCILER_INSTANCE_NAME={INSTANCE}", image, "run")

    def logs() -> str:
        return podman_cli.podman("logs", container_name, check=False).stderr[-6000:]

    _wait(lambda: _get(f"http://127.0.0.1:{port}/readyz") == 200, "/readyz to answer 200",
          60, logs)
    markers = Markers(tmp_path / "markers")
    job = project.manage("enqueue", "effect_work", json.dumps({}),
                         markers=markers.folder).strip()
    (tmp_path / "logs").mkdir()
    markers.folder.mkdir(exist_ok=True)
    processes = Processes(tmp_path / "logs")
    try:
        worker = processes.start("db-worker", worker_argv(), project.env(markers.folder),
                                 cwd=Path(__file__).parents[2])
        _wait(lambda: markers.has(f"{job}-started-1"), "the task to start", 60,
              worker.output)
        worker.kill()  # SIGKILL, as the OOM killer or a lost node would
        assert worker.popen.returncode == -signal.SIGKILL

        def decided() -> Any:
            with engine.connect() as conn:
                return conn.execute(sa.text(
                    "SELECT d.decision_reason, p.reconciler_instance FROM "
                    "reconciliation_decisions d JOIN reconciliation_passes p "
                    "ON p.pass_id = d.pass_id WHERE d.job_source = 'django-tasks' "
                    "AND d.job_id = :job AND d.disposition = 'terminalize'"),
                    {"job": job}).first()

        _wait(lambda: decided() is not None, "the container to decide the killed task", 60,
              logs)
        assert tuple(decided()) == ("worker_died_mid_step", INSTANCE)
        result = json.loads(project.manage("result", job))
        assert result["status"] == "FAILED"  # as Django's own result API reads it
    finally:
        processes.close()
        engine.dispose()
    started = time.monotonic()
    podman_cli.podman("stop", "--time", "30", container_name, timeout=60)
    state = json.loads(podman_cli.podman("inspect", container_name).stdout)[0]["State"]
    assert state["ExitCode"] == 0, logs()
    assert time.monotonic() - started < 30, logs()
