"""The functions the ``reconciler demo --source rq`` workers run (``rq worker`` imports them
by name from the job, as an app's workers do).

Each job is enqueued with ``Retry(max=RETRIES)``: its attempt is ``RETRIES + 1 -
retries_left`` (the count the rq source reads). Each hangs on its first attempt (so the
demo can SIGKILL its worker mid-job) and returns at once on a later one.
"""

from __future__ import annotations

import time

from rq import get_current_job

RETRIES = 2
"""Every demo job's ``Retry(max=...)``: RQ's own cleanup would run either again."""


def _work() -> str:
    job = get_current_job()
    left = RETRIES if job is None or job.retries_left is None else job.retries_left
    attempt = RETRIES + 1 - left
    if attempt == 1:
        time.sleep(3600)
    return f"done on attempt {attempt}"


def render() -> str:
    """Configured idempotent in the demo: resumed."""
    return _work()


def charge() -> str:
    """Configured by nobody, so effectful: failed, never run twice."""
    return _work()
