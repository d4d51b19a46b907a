"""RQ jobs of the operator and step-ledger tests, run by real ``rq worker`` processes.

Markers go to ``SOURCES_MARKERS`` as in ``rq_tasks``; the attempt is the reconciler's count
in the job's hash (``reconciler_attempt``, 1 until a resume).

- ``hang_once``: its first run ever hangs (an hour), every later one finishes at once,
  whatever its attempt number (an operator's retry starts the count again).
- ``ledger_charge``: three steps recorded in the reconciler's step ledger
  (``RECONCILER_DATABASE_URL``): ``fetch`` (idempotent), ``charge`` (effectful),
  ``notify`` (idempotent); the first attempt hangs after ``fetch`` succeeded
  (``hang="between"``) or inside ``charge`` (``hang="charge"``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from rq import get_current_job

from reconciler.ledger import Step, StepLedger

PLAN = [Step("fetch", "idempotent"), Step("charge", "effectful"),
        Step("notify", "idempotent")]


def _current() -> tuple[str, int, Path]:
    job = get_current_job()
    assert job is not None
    counted = job.connection.hget(job.key, "reconciler_attempt")
    return job.id, int(counted or 1), Path(os.environ["SOURCES_MARKERS"])


def hang_once() -> str:
    """Hangs on its first run only."""
    job_id, attempt, folder = _current()
    (folder / f"{job_id}-started-{attempt}").write_text(str(os.getpid()))
    first = folder / f"{job_id}-first-run"
    if not first.exists():
        first.write_text(str(os.getpid()))
        time.sleep(3600)
    (folder / f"{job_id}-done-{attempt}").write_text(str(os.getpid()))
    return f"done on attempt {attempt}"


def ledger_charge(hang: str = "") -> str:
    """Three recorded steps; the first attempt hangs where ``hang`` says."""
    job_id, attempt, folder = _current()
    with StepLedger(os.environ["RECONCILER_DATABASE_URL"]) as ledger:
        run = ledger.run("rq", job_id, attempt, PLAN)
        for index in run.pending():
            name = PLAN[index].step_name
            with run.step(index):
                (folder / f"{job_id}-step-{name}-{attempt}").write_text(str(os.getpid()))
                if attempt == 1 and hang == name:
                    time.sleep(3600)
            if attempt == 1 and hang == "between" and name == "fetch":
                (folder / f"{job_id}-between-{attempt}").write_text(str(os.getpid()))
                time.sleep(3600)
    return f"done on attempt {attempt}"
