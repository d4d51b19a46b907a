"""``reconciler demo --source rq``: real ``rq worker``s are SIGKILLed mid-job, and one pass
recovers their jobs the RQ way.

A throwaway redis-server (started here on a free port, stopped at the end) holds RQ's keys;
a fresh SQLite file holds the reconciler's tables. Two jobs are enqueued through RQ, each
with ``Retry(max=2)``, each taken by a worker of its own, and both workers (and their work
horses) are killed whole. A new worker comes up: its start-up maintenance runs RQ's own
``StartedJobRegistry.cleanup``, which finds nothing yet, since a dead worker's entry
expires only about 60 s after its last renewal (RQ adds a fixed minute to the heartbeat's
TTL). Rather than make the viewer wait that minute, the demo moves the two killed jobs'
entries to expired now, as the minute would, and says so; nothing else is faked, and the
reconciler still judges both signals (the entry expired, the worker silent past
``session_timeout_seconds``). One pass then resumes the idempotent job onto its queue
(one retry used; the new worker finishes it) and fails the effectful one with our reason
(``Job.fetch(...).get_status()`` and ``latest_result()`` read it), where RQ's cleanup
would have run it again, its retries left.

Without redis-server or rq (``pip install 'stale-claim-reconciler[rq]'``) it says so in one
line and exits 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from reconciler.demos.support import (
    demo_config,
    kill_tree,
    pass_until_decided,
    run_over_redis,
    say,
    wait,
)
from reconciler.root.migrations import migrate

APP = "reconciler.demos.rq_app"
SESSION_TIMEOUT_SECONDS = 2.0
# A report is safe to run again; every other job is effectful (the default).
KINDS = {f"{APP}.render": {"effect": "idempotent"}}


def run_rq_demo() -> int:
    """The demo; 0 when the killed workers' jobs were recovered as the table says."""
    return run_over_redis("RQ", ("rq", "redis"), "rq", "RQ's store", _demo)


def _demo(path: Path, redis_url: str) -> int:
    import redis  # noqa: PLC0415 - optional, checked above
    from rq import Queue, Retry  # noqa: PLC0415
    from rq.job import Job  # noqa: PLC0415

    from reconciler.demos import rq_app  # noqa: PLC0415 - imports rq

    url = f"sqlite:///{path}"
    config = demo_config(source={"kind": "rq", "redis_url": redis_url}, kinds=KINDS,
                         database_url=url, session_timeout_seconds=SESSION_TIMEOUT_SECONDS,
                         session_heartbeat_seconds=0.5, stale_after_seconds=1.0)
    migrate(config)
    say(f"redis-server at {redis_url} holds RQ's jobs; the reconciler's tables are in a "
        "SQLite file")
    connection = redis.Redis.from_url(redis_url)
    render = Queue("reports", connection=connection).enqueue(
        rq_app.render, retry=Retry(max=rq_app.RETRIES))
    charge = Queue("payments", connection=connection).enqueue(
        rq_app.charge, retry=Retry(max=rq_app.RETRIES))
    say(f"enqueued {render.id} ({APP}.render, configured idempotent) and {charge.id} "
        f"({APP}.charge, effectful by default), each with Retry(max={rq_app.RETRIES})")
    workers = [_worker(redis_url, "demo-1", "reports"),
               _worker(redis_url, "demo-2", "payments")]
    third: subprocess.Popen[bytes] | None = None
    try:
        wait(lambda: {_status(render), _status(charge)} == {"started"},
             "the workers to start both jobs")
        for worker in workers:
            kill_tree(worker)
        say("both rq workers (and their work horses) SIGKILLed mid-job: both jobs stay "
            "'started' in their queues' started registries")
        third = _worker(redis_url, "demo-3", "reports,payments")
        # A worker goes idle (its state in its key) only after its start-up maintenance,
        # RQ's own cleanup of both registries, has run.
        wait(lambda: connection.hget("rq:worker:demo-3", "state") == b"idle",
             "the new worker to start")
        say("a new worker (demo-3) started; its maintenance ran StartedJobRegistry.cleanup "
            f"and left both: {_status(render)!r}, {_status(charge)!r} (not expired yet)")
        _expire_now(connection, (render, charge))
        say("RQ lets a dead worker's entry expire about 60 s after its last renewal; "
            "instead of waiting that minute, the demo moved the killed jobs' entries to "
            "expired now")
        if not pass_until_decided(config, {render.id, charge.id}, "entry expired, worker "
                                  f"silent past {SESSION_TIMEOUT_SECONDS:g} s", noun="job"):
            return 1
        wait(lambda: _status(render) == "finished", "the new worker to finish the resumed "
             "job", timeout=60)
        finished = Job.fetch(render.id, connection=connection)
        say(f"the new worker finished {render.id}: Job.fetch(...).return_value() = "
            f"{finished.return_value()!r}")
        failed = Job.fetch(charge.id, connection=connection)
        result = failed.latest_result()
        reason = "" if result is None else (result.exc_string or "").strip().splitlines()[-1]
        status = failed.get_status().value
        say(f"{charge.id}: Job.fetch(...).get_status() = {status!r}, "
            f"latest_result(): {reason!r}")
        return 0 if status == "failed" and "worker_died_mid_step" in reason else 1
    finally:
        for process in (*workers, third):
            if process is not None and process.poll() is None:
                kill_tree(process)


def _status(job: Any) -> str:
    """The job's status as RQ's ``JobStatus`` spells it (``started``), read now."""
    return str(job.get_status(refresh=True).value)


def _expire_now(connection: Any, jobs: tuple[Any, ...]) -> None:
    """Each job's started-registry entries scored a second ago: what the minute after its
    worker's last renewal would do, and nothing more (the job, its execution and its
    worker's key are left as the kill left them)."""
    from rq.registry import StartedJobRegistry  # noqa: PLC0415 - optional, checked above

    for job in jobs:
        registry = StartedJobRegistry(job.origin, connection=connection)
        for job_id, execution_id in registry.get_job_and_execution_ids(cleanup=False):
            if job_id == job.id:
                connection.zadd(registry.key, {f"{job_id}:{execution_id}": time.time() - 1},
                                xx=True)


def _worker(redis_url: str, name: str, queues: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "rq.cli", "worker", "--url", redis_url, "--name", name,
            "--logging_level", "WARNING", *queues.split(",")]
    return subprocess.Popen(argv, env=dict(os.environ), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
