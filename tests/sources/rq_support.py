"""Real RQ over a real Redis for the source tests: ``rq worker`` processes on the tests'
own jobs (tests/sources/rq_tasks.py), enqueued through RQ's own ``Queue``.

``redis_url`` (tests/sources/celery_support.py): Debian's ``redis-server`` for the
session, emptied for each test. The reconciler's own tables are ``reconciler_engine``
(tests/sources/conftest.py), on SQLite and PostgreSQL. Workers run with a job
monitoring interval of 1 s, so a live worker renews its started-registry entry every
second and a dead one's entry expires about 61 s after its last renewal (RQ adds 60 s).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from reconciler.sources.rq import RqConfig
from tests.sources.celery_support import worker_tree
from tests.sources.support import Markers, Process, Processes, wait_until

REPO = Path(__file__).parents[2]
TASKS = "tests.sources.rq_tasks"
IDEMPOTENT = f"{TASKS}.idem_work"
EFFECTFUL = f"{TASKS}.effect_work"
MONITORING_SECONDS = 1


@dataclass(frozen=True)
class RqProject:
    """The app's Redis and the reconciler's database (either engine)."""

    redis_url: str
    engine: Engine

    def config(self, **overrides: Any) -> RqConfig:
        """The rq source's ``[source]`` over this Redis."""
        return RqConfig(**{"redis_url": self.redis_url, "session_timeout_seconds": 2.0,
                           **overrides})

    def redis(self) -> Any:
        import redis  # noqa: PLC0415 - the tests of the rq source have it

        return redis.Redis.from_url(self.redis_url)

    def queue(self, name: str = "default") -> Any:
        from rq import Queue  # noqa: PLC0415

        return Queue(name, connection=self.redis())

    def enqueue(self, func: str, *, queue: str = "default", retry: int | None = None,
                **kwargs: Any) -> str:
        """The job enqueued through RQ's own ``Queue.enqueue`` (with ``Retry(max=retry)``
        where given); its id."""
        from rq import Retry  # noqa: PLC0415

        options: dict[str, Any] = {"kwargs": kwargs}
        if retry is not None:
            options["retry"] = Retry(max=retry)
        job = self.queue(queue).enqueue(func, **options)
        return str(job.id)

    def job(self, job_id: str) -> Any:
        """RQ's own ``Job.fetch``."""
        from rq.job import Job  # noqa: PLC0415

        return Job.fetch(job_id, connection=self.redis())

    def status(self, job_id: str) -> str:
        return str(self.job(job_id).get_status().value)

    def entry_score(self, job_id: str, queue: str = "default") -> float | None:
        """The job's started-registry entry's score (None: not there)."""
        for member, score in self.redis().zrange(f"rq:wip:{queue}", 0, -1, withscores=True):
            if member.decode().startswith(f"{job_id}:"):
                return float(score)
        return None

    def expire_as_time_would(self, job_id: str, worker: Process, queue: str = "default"
                             ) -> None:
        """What the minute after a dead worker's last renewal does, now: its job's entry
        scored in the past and the worker's key gone (Redis expires it). Only for a
        worker that is dead (a live one would renew both)."""
        assert not worker.alive()
        client = self.redis()
        seconds, _ = client.time()
        for member, _ in client.zrange(f"rq:wip:{queue}", 0, -1, withscores=True):
            if member.decode().startswith(f"{job_id}:"):
                client.zadd(f"rq:wip:{queue}", {member: float(seconds) - 1})
        client.delete(f"rq:worker:{worker.name}")


def worker_argv(project: RqProject, name: str, queues: tuple[str, ...] = ("default",),
                *extra: str) -> list[str]:
    """One real ``rq worker`` (a forking worker: a work horse per job), its own name."""
    return [sys.executable, "-m", "rq.cli", "worker", "--url", project.redis_url,
            "--name", name, "--job-monitoring-interval", str(MONITORING_SECONDS),
            "--path", str(REPO), *extra, *queues]


def unique(name: str) -> str:
    """A worker name of this test's own: a worker of an earlier test on the session's
    Redis that still heartbeats while its process goes down keeps its key alive, and RQ
    refuses a second worker of an active name."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def start_worker(processes: Processes, project: RqProject, markers: Markers, name: str,
                 queues: tuple[str, ...] = ("default",), *extra: str) -> Process:
    """A worker of the app (named ``name`` and a suffix: ``unique``), its markers in
    ``markers``."""
    name = unique(name)
    return processes.start(name, worker_argv(project, name, queues, *extra),
                           {"SOURCES_MARKERS": str(markers.folder)}, cwd=REPO)


def wait_started(markers: Markers, job_id: str, worker: Process, attempt: int = 1,
                 timeout: float = 60) -> None:
    """Until the job's ``attempt`` started on a worker."""
    wait_until(lambda: markers.has(f"{job_id}-started-{attempt}"),
               f"job {job_id} attempt {attempt} to start", timeout=timeout, process=worker)


def sigkill(worker: Process) -> None:
    """SIGKILL the worker and its work horse (an OOM kill, a node lost): the worker first,
    so that it never sees its horse die and fails the job itself (RQ's own handling of a
    lost horse), then the horse, found before its parent went."""
    horses = worker_tree(worker)[:-1]
    worker.kill()
    for pid in horses:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_status(project: RqProject, job_id: str, status: str, timeout: float = 60,
                worker: Process | None = None) -> None:
    """Until RQ's own ``get_status()`` reads ``status``."""
    wait_until(lambda: project.status(job_id) == status, f"job {job_id} {status}",
               timeout=timeout, process=worker)


@pytest.fixture
def rq_project(reconciler_engine: Engine, redis_url: str) -> RqProject:
    """Redis emptied, and the reconciler's database on each engine."""
    return RqProject(redis_url, reconciler_engine)
