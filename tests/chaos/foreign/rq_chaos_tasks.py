"""The functions the rq chaos run's workers run (``rq worker -w rq.worker.SimpleWorker``,
the job in the worker's own process, so the markers name the pid the run kills).

Each job is enqueued with ``Retry(max=budget - 1)`` and ``budget`` among its keyword
arguments: its attempt is ``budget - retries_left``, the count the rq source reads (a
resume uses one retry). Each writes ``<job>-started-<attempt>`` before its work and
``<job>-done-<attempt>`` after it (``SOURCES_MARKERS``), sleeping ``hang[attempt - 1]``
seconds in between.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from rq import get_current_job


def _work(hang: list[float], budget: int) -> str:
    job = get_current_job()
    assert job is not None
    left = job.retries_left if job.retries_left is not None else 0
    attempt = budget - left
    markers = Path(os.environ["SOURCES_MARKERS"])
    (markers / f"{job.id}-started-{attempt}").write_text(str(os.getpid()))
    if attempt - 1 < len(hang):
        time.sleep(hang[attempt - 1])
    (markers / f"{job.id}-done-{attempt}").write_text(str(os.getpid()))
    return f"done on attempt {attempt}"


def idem_work(hang: list[float], budget: int) -> str:
    return _work(hang, budget)


def pure_work(hang: list[float], budget: int) -> str:
    return _work(hang, budget)


def effect_work(hang: list[float], budget: int) -> str:
    return _work(hang, budget)
