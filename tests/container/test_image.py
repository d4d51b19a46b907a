"""The sidecar's image, built here from Debian alone, recovers a killed worker's job.

The image runs as a platform team runs it: a read-only root file system (not even a
writable /tmp), one volume, the database URL from a mounted secret file, the host's
network. The worker is a process on the host, SIGKILLed mid-job; the sidecar in the
container decides its jobs; SIGTERM stops the sidecar within its grace.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa

from models import JobRun, ReconciliationDecision, ReconciliationPass
from reconciler.config.settings import Settings
from reconciler.storage.engines import create_engine
from reconciler.worker import JobClient, Step
from tests.conftest import REPO_ROOT, PostgresForTests
from tests.container import podman_cli
from tests.container.conftest import FACTS
from tests.pg_server import INSTALL_HINT

pytestmark = pytest.mark.container

jobs = cast(sa.Table, JobRun.__table__)
decisions = cast(sa.Table, ReconciliationDecision.__table__)
passes = cast(sa.Table, ReconciliationPass.__table__)

STEPS = [Step("fetch", "idempotent"), Step("render", "pure"), Step("publish", "effectful")]
VOLUME_PATH = "/var/lib/reconciler"
URL_FILE_INSIDE = "/var/run/secrets/stale-claim-reconciler/database-url"
# The image's user owns what it reads and writes (a Kubernetes fsGroup does the same).
IMAGE_UID = 10001
SHUTDOWN_GRACE_SECONDS = 30
INSTANCE = "sidecar-in-a-container"

# A worker on the host: claims both jobs with a short lease, gets one into a pure step
# and the other into an effectful one, says so, and waits to be killed.
WORKER = """
import json, sys, time
from reconciler.worker import JobClient
client = JobClient(sys.argv[1])
held = {}
for last_started in (1, 2):
    claim = client.claim(worker="doomed-worker", lease_seconds=1.0)
    for index in range(last_started):
        claim.start_step(index)
        claim.finish_step(index)
    claim.start_step(last_started)
    held[claim.job_id] = last_started
print(json.dumps({"held": held}), flush=True)
time.sleep(600)
"""


def container_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``podman run --rm`` of the image with this machine's flags, not raising."""
    return podman_cli.podman("run", "--rm", *podman_cli.run_flags(), *args, check=False,
                             timeout=timeout)


@pytest.fixture
def volume() -> Iterator[str]:
    """A named volume of the test's own (the image's volume is copied into it)."""
    name = f"reconciler-test-{uuid.uuid4().hex[:8]}"
    podman_cli.podman("volume", "create", name)
    yield name
    podman_cli.podman("volume", "rm", "--force", name, check=False)


@pytest.fixture
def empty_postgres_url(postgres: PostgresForTests | None) -> Iterator[str]:
    """A URL of an empty PostgreSQL database (the container migrates it)."""
    if postgres is None:
        pytest.skip(f"PostgreSQL not available: {INSTALL_HINT}")
    name = postgres.new_database(migrated=False)
    yield postgres.url(name)
    postgres.drop(name)


@pytest.fixture
def secret_file(tmp_path: Path, empty_postgres_url: str) -> Path:
    """The database URL in a file only the image's user reads, as a mounted Secret."""
    path = tmp_path / "database-url"
    path.write_text(empty_postgres_url + "\n")
    os.chown(path, IMAGE_UID, IMAGE_UID)
    path.chmod(0o400)
    return path


def test_the_image_runs_as_a_numeric_non_root_user_and_says_what_it_is(image: str) -> None:
    """User, entry point, command, port, volume, health check and labels, as documented."""
    record = podman_cli.inspect_image(image)
    config = cast(dict[str, Any], record["Config"])
    user = str(config["User"])
    uid = user.split(":", 1)[0]
    assert uid.isdigit(), f"a numeric user, not {user!r}"
    assert int(uid) != 0, user
    assert (config["Entrypoint"], config["Cmd"]) == (["reconciler"], ["run"])
    port = Settings.model_fields["metrics_port"].default
    assert f"{port}/tcp" in config["ExposedPorts"]
    assert VOLUME_PATH in config["Volumes"]
    assert "RECONCILER_METRICS_HOST=0.0.0.0" in config["Env"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == podman_cli.VERSION
    assert "org.opencontainers.image.source" in labels
    health = cast(dict[str, Any], record["Healthcheck"])
    assert "/healthz" in " ".join(health["Test"])
    size = int(cast(int, record["Size"]))
    FACTS["image"] = image
    FACTS["size"] = f"{size / 1e6:.0f} MB ({size} bytes)"
    FACTS["user"] = user


def test_the_default_database_is_sqlite_on_the_volume_under_a_read_only_root(
    image: str, volume: str
) -> None:
    """With nothing set, `db upgrade` makes its SQLite file on the volume and a second
    container on the same volume reads it: the volume is the only place written."""
    mounts = ["--read-only", "--read-only-tmpfs=false", "-v", f"{volume}:{VOLUME_PATH}"]
    upgraded = container_run(*mounts, image, "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    listed = container_run(*mounts, image, "jobs", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == []
    files = container_run(*mounts, "--entrypoint", "ls", image, VOLUME_PATH)
    assert "reconciler.db" in files.stdout.split()


def _free_port() -> int:
    import socket  # noqa: PLC0415 - only here

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _wait(check: Callable[[], bool], what: str, timeout: float, logs: Callable[[], str]
          ) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; the "
                        f"container's log:\n{logs()}")
        time.sleep(0.2)


@pytest.fixture
def container_name() -> Iterator[str]:
    """The sidecar container's name; it is removed, running or not, at the end."""
    name = f"reconciler-test-{uuid.uuid4().hex[:8]}"
    yield name
    podman_cli.podman("rm", "--force", "--time", "0", name, check=False)


def test_the_sidecar_in_the_container_recovers_a_killed_workers_jobs_and_stops_on_sigterm(
    image: str, volume: str, secret_file: Path, empty_postgres_url: str, container_name: str
) -> None:
    """`db upgrade`, `run`, /readyz; a host worker SIGKILLed mid-job: its job in a pure
    step is requeued at that step, its job in an effectful step ends failed
    (worker_died_mid_step), both decided by the container's instance; the health check
    passes; SIGTERM ends the container with 0 within the grace."""
    port = _free_port()
    common = [
        "--network", "host", "--read-only", "--read-only-tmpfs=false",
        "-v", f"{volume}:{VOLUME_PATH}", "-v", f"{secret_file}:{URL_FILE_INSIDE}:ro",
        "-e", f"RECONCILER_DATABASE_URL_FILE={URL_FILE_INSIDE}",
    ]
    upgraded = container_run(*common, image, "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr

    settings = ["-e", f"RECONCILER_METRICS_PORT={port}", "-e", "RECONCILER_INTERVAL_SECONDS=1",
                "-e", "RECONCILER_STALE_AFTER_SECONDS=0",
                "-e", f"RECONCILER_INSTANCE_NAME={INSTANCE}"]
    podman_cli.podman("run", "--detach", "--name", container_name, *podman_cli.run_flags(),
                      # No systemd here to time the image's health check: the test runs it.
                      "--health-interval", "disable", *common, *settings, image)

    def logs() -> str:
        return podman_cli.podman("logs", container_name, check=False).stderr[-6000:]

    base = f"http://127.0.0.1:{port}"
    _wait(lambda: _get(f"{base}/readyz") == 200, "/readyz to answer 200", 60, logs)
    health = podman_cli.podman("healthcheck", "run", container_name, check=False)
    assert health.returncode == 0, health.stdout + health.stderr

    with JobClient(empty_postgres_url) as client:
        pure_job = client.enqueue("report", steps=STEPS, max_attempts=3)
        effectful_job = client.enqueue("report", steps=STEPS, max_attempts=3)
    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WORKER),
                               empty_postgres_url], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        assert worker.stdout is not None
        line = worker.stdout.readline()
        assert line, worker.communicate(timeout=30)[1]
        held = {int(k): v for k, v in json.loads(line)["held"].items()}
        assert held == {pure_job: 1, effectful_job: 2}
    finally:
        worker.send_signal(signal.SIGKILL)
        assert worker.wait(timeout=30) == -signal.SIGKILL

    engine = create_engine(empty_postgres_url)
    try:
        def decided() -> bool:
            with engine.connect() as conn:
                return all(conn.execute(sa.select(jobs.c.job_status).where(
                    jobs.c.job_id == job_id)).scalar_one() != "processing" for job_id in held)

        _wait(decided, "the sidecar to decide the killed worker's jobs", 60, logs)
        with engine.connect() as conn:
            rows = {row.job_id: row for row in conn.execute(
                sa.select(jobs).where(jobs.c.job_id.in_(list(held))))}
            made = conn.execute(
                sa.select(decisions.c.job_id, decisions.c.disposition,
                          decisions.c.decision_reason, passes.c.reconciler_instance)
                .join(passes, passes.c.pass_id == decisions.c.pass_id)
                .where(decisions.c.disposition != "skip")).all()
    finally:
        engine.dispose()
    assert (rows[pure_job].job_status, rows[pure_job].resume_step_index) == ("queued", 1)
    assert (rows[effectful_job].job_status, rows[effectful_job].status_reason) == (
        "failed", "worker_died_mid_step")
    assert sorted((int(r.job_id), r.disposition, r.reconciler_instance) for r in made) == [
        (pure_job, "resume", INSTANCE), (effectful_job, "terminalize", INSTANCE)]

    started = time.monotonic()
    podman_cli.podman("stop", "--time", str(SHUTDOWN_GRACE_SECONDS), container_name,
                      timeout=SHUTDOWN_GRACE_SECONDS + 30)
    stopped_in = time.monotonic() - started
    state = json.loads(podman_cli.podman("inspect", container_name).stdout)[0]["State"]
    assert state["ExitCode"] == 0, logs()
    assert stopped_in < SHUTDOWN_GRACE_SECONDS, logs()
    assert "event=service_stopped" in logs()
    FACTS["SIGTERM to exit"] = f"{stopped_in:.1f} s (exit {state['ExitCode']})"
