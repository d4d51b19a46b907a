"""The Celery app of the chaos runs' workers (``celery -A tests.chaos.foreign.celery_chaos_app
worker``): tests/sources/celery_app.py's app and tasks, acknowledging early (Celery's
default), with what a careful operator of a database result backend sets, and one more
marker.

- ``<job>-accepted-<attempt>`` on ``task_prerun``: the worker has accepted the task (its
  acknowledgement is scheduled: a solo worker sends it when the task returns, or as it
  stops) and has not yet written the ``STARTED`` row. A worker that stops in between, on a
  result write that failed, acknowledges the message on its way out: Celery has lost the
  task, with no message and no running row for the reconciler to find. The checks tell
  those apart.
- Result writes retried through a PostgreSQL restart: the database backend retries a
  failed write 3 times within a fraction of a second by default, then the worker stops
  ("Unrecoverable error") as above.
- kombu's sweep that puts a message a killed worker held unacknowledged back on its queue
  runs every second, not every 100 s (kombu 5.7's ``unacked_restore_interval`` 10 s times
  ``unacked_restore_throttle`` 10): such a message runs again once the visibility timeout
  has passed, within the run.
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
    """The task is accepted (its message's acknowledgement scheduled); the ``STARTED`` row
    is not written yet."""
    if task_id is not None and task is not None:
        mark(f"{task_id}-accepted-{task.request.retries + 1}")
