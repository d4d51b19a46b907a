"""``reconciler demo --source celery``: real Celery workers are SIGKILLed mid-task, and one
pass recovers their tasks the Celery way.

A throwaway redis-server (started here on a free port, stopped at the end) is the broker;
a fresh SQLite file holds the reconciler's tables and Celery's database result backend.
Two tasks are sent through Celery, each taken by a prefork worker, and both workers are
killed whole, and a new worker of the app comes up (silence is evidence of death only
while some worker answers). Once the killed ones have been silent to Celery's ping past
``session_timeout_seconds``, a pass (configured as ``[source] kind = "celery"`` would
configure it) moves the idempotent task to ``RETRY`` and re-publishes it, and fails the
effectful one; the new worker finishes the first (the caller's ``AsyncResult.get()``
returns), and the second's ``get()`` raises ``WorkerLostError`` at once.

Without redis-server or Celery (``pip install 'stale-claim-reconciler[celery]'``) it says
so in one line and exits 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa

from reconciler.demos.support import (
    demo_config,
    kill_tree,
    pass_until_decided,
    run_over_redis,
    say,
    wait,
)
from reconciler.root.migrations import migrate

SESSION_TIMEOUT_SECONDS = 2.0
# A report is safe to run again; every other task is effectful (the default).
KINDS = {"reports.*": {"effect": "idempotent"}}


def run_celery_demo() -> int:
    """The demo; 0 when the killed workers' tasks were recovered as the table says."""
    return run_over_redis("Celery", ("celery", "redis"), "celery", "its broker", _demo)


def _demo(path: Path, broker_url: str) -> int:
    url = f"sqlite:///{path}"
    env = {**os.environ, "DEMO_BROKER_URL": broker_url, "DEMO_DATABASE_URL": url}
    os.environ.update(DEMO_BROKER_URL=broker_url, DEMO_DATABASE_URL=url)
    from celery.backends.database.models import TaskExtended  # noqa: PLC0415

    from reconciler.demos.celery_app import app  # noqa: PLC0415 - reads the env above

    config = demo_config(source={"kind": "celery", "broker_url": broker_url}, kinds=KINDS,
                         database_url=url, session_timeout_seconds=SESSION_TIMEOUT_SECONDS,
                         session_heartbeat_seconds=0.5, stale_after_seconds=1.0)
    engine = sa.create_engine(url)
    try:
        TaskExtended.metadata.create_all(engine)  # Celery's own result tables
        migrate(config)  # the reconciler's tables; Celery's are there to check
        say(f"redis-server at {broker_url}; Celery's result tables and the reconciler's "
            "in one SQLite file")
        render = app.send_task("reports.render", queue="reports")
        charge = app.send_task("payments.charge", queue="payments")
        say(f"sent {render.id} (reports.render, configured idempotent) and {charge.id} "
            "(payments.charge, effectful by default)")
        workers = [_worker(env, "demo-1", "reports"), _worker(env, "demo-2", "payments")]
        second: subprocess.Popen[bytes] | None = None
        try:
            wait(lambda: {render.state, charge.state} == {"STARTED"},
                 "the workers to start both tasks")
            for worker in workers:
                kill_tree(worker)
            say("both Celery workers SIGKILLed mid-task: both rows stay STARTED")
            # Silence is evidence of death only while some worker of the app answers: the
            # fleet's next worker comes up before the passes.
            second = _worker(env, "demo-3", "reports,payments")
            say("a new worker (demo-3) answers ping; the killed ones stay silent")
            if not pass_until_decided(config, {render.id, charge.id}, "silent to ping past "
                                      f"{SESSION_TIMEOUT_SECONDS:g} s"):
                return 1
            say(f"the new worker finished {render.id}: AsyncResult.get() = "
                f"{render.get(timeout=60)!r}")
            try:
                charge.get(timeout=5)
            except Exception as failed:
                say(f"{charge.id}: AsyncResult.get() raised at once: "
                    f"{type(failed).__name__}({str(failed).split(' ', 1)[0]!r} ...)")
                return 0 if type(failed).__name__ == "WorkerLostError" else 1
            say(f"{charge.id} returned: the effectful task ran again")
            return 1
        finally:
            for process in (*workers, second):
                if process is not None and process.poll() is None:
                    kill_tree(process)
    finally:
        engine.dispose()


def _worker(env: dict[str, str], name: str, queues: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "celery", "-A", "reconciler.demos.celery_app", "worker",
            "--pool=prefork", "--concurrency=1", f"--hostname={name}@demo", "-Q", queues,
            "--without-mingle", "--without-gossip", "--loglevel=WARNING"]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
