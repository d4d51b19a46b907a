"""The RQ jobs of the source tests, run by real ``rq worker`` processes (``rq_support``).

Each writes marker files as it goes (``<job id>-started-<attempt>``, then
``<job id>-done-<attempt>``; the attempt is the reconciler's count in the job's hash,
``reconciler_attempt``, 1 until a resume) into ``SOURCES_MARKERS`` and sleeps
``hang[attempt - 1]`` seconds between (default: the first attempt, an hour).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from rq import get_current_job


def _attempt() -> tuple[str, int]:
    job = get_current_job()
    assert job is not None
    counted = job.connection.hget(job.key, "reconciler_attempt")
    return job.id, int(counted or 1)


def _work(hang: list[float] | None) -> str:
    job_id, attempt = _attempt()
    folder = Path(os.environ["SOURCES_MARKERS"])
    (folder / f"{job_id}-started-{attempt}").write_text(str(os.getpid()))
    seconds = [3600.0] if hang is None else hang
    if attempt - 1 < len(seconds):
        time.sleep(seconds[attempt - 1])
    (folder / f"{job_id}-done-{attempt}").write_text(str(os.getpid()))
    return f"done on attempt {attempt}"


def idem_work(hang: list[float] | None = None) -> str:
    """An idempotent job (``[kinds]`` say so): safe to run again from the start."""
    return _work(hang)


def effect_work(hang: list[float] | None = None) -> str:
    """An effectful job: a run of unknown progress is never repeated."""
    return _work(hang)
