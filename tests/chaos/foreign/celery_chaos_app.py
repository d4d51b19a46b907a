"""The Celery app of the chaos runs' workers (``celery -A tests.chaos.foreign.celery_chaos_app
worker``): tests/sources/celery_app.py's app and tasks, acknowledging early (Celery's
default), with what a careful operator of a database result backend sets, and one more
marker.

- ``<job>-accepted-<attempt>`` on ``task_prerun``: the worker has acknowledged the message
  (with early acknowledgement the solo pool acknowledges as it accepts the task, before
  prerun) and has not yet written the task's ``STARTED`` row. A worker that dies between
  the two has lost the task, by Celery's own at-most-once delivery: no message is left and
  no ``STARTED`` row was written for the reconciler to find. The checks tell those apart.
- Result writes retried through a PostgreSQL restart: the database backend retries a
  failed write 3 times within about 0.1 s by default, then the worker stops
  ("Unrecoverable error") with the message acknowledged and no ``STARTED`` row.
- kombu's sweep that puts a message a killed worker held unacknowledged back on its queue
  runs every second, not every 100 s (kombu 5.7's ``unacked_restore_interval`` 10 s times
  ``unacked_restore_throttle`` 10): such a message runs again once the visibility
  timeout has passed, within the run.
"""

from __future__ import annotations

from typing import Any

from celery.signals import task_prerun

from tests.sources.celery_app import app, mark

__all__ = ["app"]

RESULT_WRITE_RETRIES = 120
"""With backoff up to 0.5 s (full jitter), a result write waits out about 30 s of outage."""

app.conf.update(
    result_backend_max_retries=RESULT_WRITE_RETRIES,
    result_backend_base_sleep_between_retries_ms=50,
    result_backend_max_sleep_between_retries_ms=500,
    broker_transport_options={**app.conf.broker_transport_options,
                              "unacked_restore_interval": 1,
                              "unacked_restore_throttle": 1},
)


@task_prerun.connect
def _accepted(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    """The message is acknowledged; the ``STARTED`` row is not written yet."""
    if task_id is not None and task is not None:
        mark(f"{task_id}-accepted-{task.request.retries + 1}")
