"""A real Procrastinate app and worker for the source tests (run as a process of its own).

``python -m tests.sources.procrastinate_app`` runs one worker with a fast heartbeat. Its
tasks write marker files (``<job>-started-<attempt>``, ``<job>-done-<attempt>``) and sleep
``hang[attempt]`` seconds on the attempts the list covers (default: the first, an hour), so
a test can kill or stop the worker mid-task. ``ledger.charge`` records its three steps
through the step ledger and sleeps after the step named ``hang_after``.

Environment: ``SOURCES_PG_CONNINFO`` (libpq, with the search path of Procrastinate's schema),
``SOURCES_MARKERS`` (a folder), ``SOURCES_DATABASE_URL`` (the reconciler's database, for the
ledger).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from procrastinate import App, JobContext, PsycopgConnector

if TYPE_CHECKING:
    from reconciler.ledger import StepLedger

HEARTBEAT_SECONDS = 0.3
POLL_SECONDS = 0.1

app = App(connector=PsycopgConnector(conninfo=os.environ.get("SOURCES_PG_CONNINFO", "")))


def mark(name: str) -> None:
    """Leave a marker file the test waits for."""
    folder = Path(os.environ["SOURCES_MARKERS"])
    (folder / name).write_text(str(os.getpid()))


def pause(hang: list[float] | None, attempt: int) -> None:
    """Sleep as long as ``hang`` says for this attempt (default: the first, an hour)."""
    seconds = [3600.0] if hang is None else hang
    if attempt < len(seconds):
        time.sleep(seconds[attempt])


def work(context: JobContext, hang: list[float] | None = None) -> None:
    """Start, hang on the attempts ``hang`` covers, finish."""
    job = context.job
    attempt = job.attempts
    mark(f"{job.id}-started-{attempt}")
    pause(hang, attempt)
    mark(f"{job.id}-done-{attempt}")


for task_name in ("idem.work", "effect.work", "pure.work", "skip.work"):
    app.task(name=task_name, pass_context=True)(work)


_ledger: list[StepLedger] = []


def ledger() -> StepLedger:
    """One step ledger per worker process, opened on first use (only the tasks that record
    steps pay for importing it)."""
    if not _ledger:
        from reconciler.ledger import StepLedger  # noqa: PLC0415 - only ledger tasks pay

        _ledger.append(StepLedger(os.environ["SOURCES_DATABASE_URL"]))
    return _ledger[0]


@app.task(name="ledger.charge", pass_context=True)
def ledger_charge(context: JobContext, hang_after: str = "fetch",
                  hang: list[float] | None = None) -> None:
    """fetch (idempotent), charge (effectful), notify (pure), through the step ledger;
    sleeps after the step named ``hang_after`` as ``hang`` says for the attempt."""
    from reconciler.ledger import Step  # noqa: PLC0415 - only ledger tasks pay for it

    job = context.job
    assert job.id is not None
    plan = [Step("fetch", "idempotent"), Step("charge", "effectful"), Step("notify", "pure")]
    run = ledger().run("procrastinate", job.id, job.attempts, plan)
    mark(f"{job.id}-pending-{job.attempts}-{','.join(map(str, run.pending()))}")
    for index in run.pending():
        with run.step(index):
            mark(f"{job.id}-step-{plan[index].step_name}-{job.attempts}")
        if plan[index].step_name == hang_after:
            pause(hang, job.attempts)
    mark(f"{job.id}-done-{job.attempts}")


def main() -> None:
    """One worker: every queue, one job at a time, a fast heartbeat."""
    options: dict[str, Any] = {
        "concurrency": 1, "wait": True, "fetch_job_polling_interval": POLL_SECONDS,
        "update_heartbeat_interval": HEARTBEAT_SECONDS,
        "stalled_worker_timeout": float(os.environ.get("SOURCES_STALLED_SECONDS", "1.5")),
        "listen_notify": True,
    }
    app.run_worker(**options)


if __name__ == "__main__":
    main()
