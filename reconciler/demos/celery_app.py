"""The Celery app the ``reconciler demo --source celery`` workers run.

Broker ``DEMO_BROKER_URL`` (the demo's own redis-server), results in Celery's database
backend on ``DEMO_DATABASE_URL`` (the demo's SQLite file, beside the reconciler's tables),
with ``task_track_started`` and ``result_extended`` as the celery source needs. Each task
hangs on its first attempt (so the demo can SIGKILL its worker mid-task) and returns at
once on a later one.
"""

from __future__ import annotations

import os
import time

from celery import Celery, Task

app = Celery("reconciler-demo", broker=os.environ.get("DEMO_BROKER_URL", "memory://"),
             backend="db+" + os.environ.get("DEMO_DATABASE_URL", "sqlite://"))
app.conf.update(task_track_started=True, result_extended=True, task_serializer="json",
                result_serializer="json", accept_content=["json"],
                worker_prefetch_multiplier=1, worker_hijack_root_logger=False)


def _work(task: Task) -> str:
    attempt = task.request.retries + 1
    if attempt == 1:
        time.sleep(3600)
    return f"done on attempt {attempt}"


def _render(self: Task) -> str:
    """Configured idempotent in the demo: resumed."""
    return _work(self)


def _charge(self: Task) -> str:
    """Configured by nobody, so effectful: failed, never run twice."""
    return _work(self)


# Each in a queue of its own, so each demo worker takes exactly one.
render = app.task(name="reports.render", bind=True, queue="reports")(_render)
charge = app.task(name="payments.charge", bind=True, queue="payments")(_charge)
