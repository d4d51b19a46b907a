"""The Python systems of the foreign chaos runs: Django Tasks (django-tasks-db, its own
``db_worker`` processes) and Celery (its database result backend, a Redis broker of the
run's own, ``celery worker`` processes). Their tasks (tests/sources/django_app/tasks.py,
tests/sources/celery_app.py) leave the same markers as the others'; neither system keeps a
budget, so ``[kinds."*"]`` holds one, and neither has liveness the chaos run can rely on
(Django Tasks none, a solo Celery worker running a task does not answer ping), so a dead
worker's task waits out ``max_run_seconds``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.chaos.foreign.database import Database
from tests.chaos.foreign.processes import die_with_parent
from tests.chaos.foreign.systems import REPO_ROOT, JobSpec, JobState, SystemBase, UnavailableError

MAX_ATTEMPTS = 4
DJANGO_TABLE = "django_tasks_database_dbtaskresult"
DJANGO_TASKS = "tests.sources.django_app.tasks."
REDIS_HINT = "redis-server is needed for the Celery run: apt-get install -y redis-server"
VISIBILITY_TIMEOUT_SECONDS = 20.0
"""How long Redis keeps a message a killed worker fetched but never acknowledged (killed
between its fetch and the task's start) before any worker puts it back on its queue."""


class DjangoTasks(SystemBase):
    """Django 5.2 with the django-tasks backport: no heartbeat, ``worker_ids`` counts
    claims (``TaskContext.attempt``), a task's end written by id only."""

    name = "django-tasks"
    completion_fenced = False  # save(update_fields=...) by id

    def __init__(self, max_run_seconds: float, max_attempts: int = MAX_ATTEMPTS) -> None:
        self.reclaim_after_seconds = max_run_seconds
        self.max_attempts = max_attempts

    def _env(self, db: Database, markers: Path) -> dict[str, str]:
        return {"SOURCES_DJANGO_DB": db.libpq, "SOURCES_MARKERS": str(markers),
                "SOURCES_DATABASE_URL": db.url,
                "DJANGO_SETTINGS_MODULE": "tests.sources.django_app.settings"}

    def _manage(self, db: Database, *args: str, stdin: str | None = None) -> str:
        try:
            import django_tasks_db  # noqa: F401, PLC0415 - only a presence check
        except ImportError as exc:
            raise UnavailableError("django-tasks-db is not installed: "
                                   "pip install -e '.[test]'") from exc
        done = subprocess.run(
            [sys.executable, "-m", "tests.sources.django_app.manage", *args], input=stdin,
            capture_output=True, text=True, timeout=300, check=False, cwd=REPO_ROOT,
            env={**os.environ, **self._env(db, Path(tempfile.gettempdir()))})
        if done.returncode != 0:
            raise RuntimeError(f"django {args[0]} failed: {done.stderr.strip()[-800:]}")
        return done.stdout

    def prepare(self, db: Database) -> None:
        self._manage(db, "migrate", "-v0")

    def source_table(self) -> dict[str, str]:
        return {}

    def settings(self) -> dict[str, float]:
        return {}

    def kind_rule(self) -> dict[str, float]:
        return {"max_run_seconds": self.reclaim_after_seconds,
                "max_attempts": self.max_attempts}

    def kind_pattern(self, pattern: str) -> str:
        # A task's kind is its path: idem.* is tests.sources.django_app.tasks.idem_*.
        return DJANGO_TASKS + pattern.replace(".", "_")

    def enqueue(self, db: Database, jobs: Sequence[JobSpec]) -> list[str]:
        payload = [{"task": s.kind.replace(".", "_"), "kwargs": {"hang": list(s.hang)},
                    "delay": s.delay_seconds} for s in jobs]
        return self._manage(db, "enqueue-many", stdin=json.dumps(payload)).split()

    def worker_command(self, db: Database, markers: Path, slot: int = 0
                       ) -> tuple[list[str], dict[str, str]]:
        from tests.sources.django_tasks_support import worker_argv  # noqa: PLC0415 - pytest

        return worker_argv(), self._env(db, markers)

    def used_of(self, marker_attempt: int) -> int:
        return marker_attempt  # the claim appended its worker already

    def states(self, db: Database, specs: Mapping[str, JobSpec]) -> dict[str, JobState]:
        rows = db.query(f"SELECT id::text, status, jsonb_array_length(worker_ids), "
                        f"extract(epoch FROM finished_at) FROM {DJANGO_TABLE}")
        mapped = {"READY": "queued", "RUNNING": "running", "SUCCESSFUL": "completed",
                  "FAILED": "failed"}
        return {job: JobState(mapped.get(status, status), used, self.max_attempts,
                              None if done is None or status != "SUCCESSFUL" else float(done))
                for job, status, used, done in rows if job in specs}


class Celery(SystemBase):
    """Celery 5 with ``task_track_started`` and ``result_extended``: a solo worker per
    process (the task runs in the worker process, so its markers name the pid the run
    kills), ``--disable-prefetch`` (a killed worker holds no message it has not started),
    attempts ``retries + 1``, a task's end written by id only."""

    name = "celery"
    completion_fenced = False  # the result backend's store_result by task id

    def __init__(self, max_run_seconds: float, max_attempts: int = MAX_ATTEMPTS,
                 session_timeout_seconds: float = 3.0) -> None:
        self.reclaim_after_seconds = max_run_seconds
        self.max_attempts = max_attempts
        self.session_timeout_seconds = session_timeout_seconds
        self.redis: subprocess.Popen[bytes] | None = None
        self.redis_dir: Path | None = None
        self.broker_url = ""
        self.feeder: threading.Thread | None = None
        self.stopping = threading.Event()
        self.sent: set[str] = set()
        """Task ids the run's sender has published (``send_task`` returned)."""

    def prepare(self, db: Database) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise UnavailableError(REDIS_HINT)
        try:
            import redis  # noqa: PLC0415 - optional (test extra)
            from celery.backends.database.models import TaskExtended  # noqa: PLC0415
        except ImportError as exc:
            raise UnavailableError("celery[redis] is not installed: "
                                   "pip install -e '.[test]'") from exc
        from reconciler.storage.engines import create_engine  # noqa: PLC0415

        engine = create_engine(db.url)
        try:
            TaskExtended.metadata.create_all(engine)
        finally:
            engine.dispose()
        self.redis_dir = Path(tempfile.mkdtemp(prefix="chaos-redis-"))
        port = _free_port()
        self.redis = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.redis_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent)  # noqa: PLW1509 - started from the main thread
        self.broker_url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(self.broker_url)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.redis.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def close(self) -> None:
        self.stopping.set()
        if self.feeder is not None:
            self.feeder.join(timeout=30)
        stop_redis(self.redis, self.redis_dir)

    def source_table(self) -> dict[str, str]:
        return {"broker_url": self.broker_url}

    def settings(self) -> dict[str, float]:
        return {"session_timeout_seconds": self.session_timeout_seconds}

    def kind_rule(self) -> dict[str, float]:
        return {"max_run_seconds": self.reclaim_after_seconds,
                "max_attempts": self.max_attempts}

    def enqueue(self, db: Database, jobs: Sequence[JobSpec]) -> list[str]:
        """Task ids chosen now; each task sent through ``send_task`` when it is due, by a
        thread (a countdown would hand it to a worker at once, to hold unacknowledged
        until then: a killed worker's held tasks would wait out the visibility timeout)."""
        ids = [str(uuid.uuid4()) for _ in jobs]
        schedule = sorted(zip((s.delay_seconds for s in jobs), ids, jobs, strict=True))
        self.feeder = threading.Thread(target=self._feed, args=(db, schedule), daemon=True)
        self.feeder.start()
        return ids

    def _feed(self, db: Database, schedule: list[tuple[float, str, JobSpec]]) -> None:
        from celery import Celery as CeleryApp  # noqa: PLC0415 - optional (test extra)

        app = CeleryApp("chaos-caller", broker=self.broker_url, backend=f"db+{db.url}",
                        set_as_current=False)
        app.conf.update(task_serializer="json", accept_content=["json"])
        started = time.monotonic()
        with app.producer_or_acquire() as producer:
            for delay, job, spec in schedule:
                if self.stopping.wait(max(0.0, started + delay - time.monotonic())):
                    return
                app.send_task(spec.kind, kwargs={"hang": list(spec.hang)}, task_id=job,
                              producer=producer)
                self.sent.add(job)

    def worker_command(self, db: Database, markers: Path, slot: int = 0
                       ) -> tuple[list[str], dict[str, str]]:
        # A new name each start: a restarted worker must not answer for a dead one.
        name = f"chaos-{uuid.uuid4().hex[:8]}@chaos"
        return [sys.executable, "-m", "celery", "-A", "tests.chaos.foreign.celery_chaos_app",
                "worker",
                "--pool=solo", f"--hostname={name}", "--disable-prefetch",
                "--without-mingle", "--without-gossip", "--loglevel=INFO"], {
            "SOURCES_BROKER_URL": self.broker_url, "SOURCES_DATABASE_URL": db.url,
            "SOURCES_MARKERS": str(markers),
            "SOURCES_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT_SECONDS)}

    def used_of(self, marker_attempt: int) -> int:
        return marker_attempt  # retries + 1

    def whereabouts(self, db: Database, jobs: Sequence[str]) -> dict[str, str]:
        """Where each job is: ``<row status or no_row>/<sent or not_sent>/<its messages on
        the queue and unacknowledged>``, read from the result table and Redis before it
        stops."""
        rows, queued, held = self._copies(db, jobs)
        return {job: f"{rows.get(job, 'no_row')}/{'sent' if job in self.sent else 'not_sent'}"
                     f"/queued {queued.count(job)} unacked {held.count(job)}" for job in jobs}

    def vanished(self, db: Database, jobs: Sequence[str]) -> set[str]:
        """Jobs the run's sender published of which Redis holds no message any more,
        neither queued nor unacknowledged."""
        _, queued, held = self._copies(db, jobs)
        return {job for job in jobs if job in self.sent and job not in queued
                and job not in held}

    def _copies(self, db: Database, jobs: Sequence[str]
                ) -> tuple[dict[str, str], list[str], list[str]]:
        """The jobs' rows' statuses, and the task ids of the messages queued and held
        unacknowledged in Redis."""
        import redis  # noqa: PLC0415 - optional (test extra)

        client = redis.Redis.from_url(self.broker_url)
        queued = [json.loads(raw)["headers"]["id"] for raw in client.lrange("celery", 0, -1)]
        held = [json.loads(raw)[0]["headers"]["id"] for raw in client.hvals("unacked")]
        rows = dict(db.query("SELECT task_id, status FROM celery_taskmeta "
                             "WHERE task_id = ANY(%(jobs)s)", {"jobs": list(jobs)}))
        return rows, queued, held

    def states(self, db: Database, specs: Mapping[str, JobSpec]) -> dict[str, JobState]:
        rows = {job: rest for job, *rest in db.query(
            # date_done: UTC written into a column without a zone, in the session's zone.
            "SELECT task_id, status, retries, extract(epoch FROM date_done AT TIME ZONE "
            "current_setting('TimeZone')) "
            "FROM celery_taskmeta")}
        mapped = {"PENDING": "queued", "RECEIVED": "queued", "RETRY": "queued",
                  "STARTED": "running", "SUCCESS": "completed", "FAILURE": "failed",
                  "REVOKED": "failed"}
        states = {}
        for job in specs:
            if job not in rows:  # not sent yet, or queued: the backend stores no PENDING
                states[job] = JobState("queued", 0, self.max_attempts)
                continue
            status, retries, done = rows[job]
            states[job] = JobState(
                mapped.get(status, status), (retries or 0) + 1, self.max_attempts,
                None if done is None or status != "SUCCESS" else float(done))
        return states


def stop_redis(process: subprocess.Popen[bytes] | None, folder: Path | None) -> None:
    """A run's own redis-server stopped (SIGTERM, then SIGKILL after 10 s), its folder
    removed."""
    if process is not None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
