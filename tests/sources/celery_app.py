"""A real Celery app for the source tests (its workers run as processes of their own).

Broker: ``SOURCES_BROKER_URL`` (the tests' own redis-server); results: Celery's database
backend on ``SOURCES_DATABASE_URL`` (the reconciler's database), or with
``SOURCES_RESULTS=django-db`` django-celery-results in the Django project
tests/sources/celery_django (the same database), with ``task_track_started`` and
``result_extended`` as the celery source needs. ``SOURCES_ACKS_LATE=1`` turns on
``task_acks_late``; ``SOURCES_VISIBILITY_TIMEOUT`` is the broker's redelivery delay. Tasks
write marker files (``<id>-started-<attempt>``, ``<id>-done-<attempt>``; the attempt is
``retries + 1``) and sleep ``hang[attempt - 1]``
seconds (default: the first attempt, an hour). ``ledger.charge`` records its three steps
through the step ledger.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery, Task

_database = os.environ.get("SOURCES_DATABASE_URL", "sqlite://")
_backend = f"db+{_database}"
if os.environ.get("SOURCES_RESULTS") == "django-db":
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.sources.celery_django.settings")
    django.setup()
    _backend = "django-db"
app = Celery("sources-tests", broker=os.environ.get("SOURCES_BROKER_URL", "memory://"),
             backend=_backend)
app.conf.update(
    task_track_started=True, result_extended=True, task_serializer="json",
    result_serializer="json", accept_content=["json"], worker_prefetch_multiplier=1,
    task_acks_late=os.environ.get("SOURCES_ACKS_LATE") == "1",
    broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
    # How long the broker keeps an unacknowledged message before putting it back.
    broker_transport_options={"visibility_timeout": float(
        os.environ.get("SOURCES_VISIBILITY_TIMEOUT", "3600"))},
)


def mark(name: str) -> None:
    """Leave a marker file the test waits for."""
    (Path(os.environ["SOURCES_MARKERS"]) / name).write_text(str(os.getpid()))


def pause(hang: list[float] | None, attempt: int) -> None:
    seconds = [3600.0] if hang is None else hang
    if attempt - 1 < len(seconds):
        time.sleep(seconds[attempt - 1])


def _work(task: Task, hang: list[float] | None) -> str:
    job, attempt = task.request.id, task.request.retries + 1
    mark(f"{job}-started-{attempt}")
    pause(hang, attempt)
    mark(f"{job}-done-{attempt}")
    return f"done on attempt {attempt}"


@app.task(name="idem.work", bind=True)
def idem_work(self: Task, hang: list[float] | None = None) -> str:
    return _work(self, hang)


@app.task(name="pure.work", bind=True)
def pure_work(self: Task, hang: list[float] | None = None) -> str:
    return _work(self, hang)


@app.task(name="idem.echo", bind=True)
def idem_echo(self: Task, *args: Any, hang: list[float] | None = None, **kwargs: Any
              ) -> list[Any]:
    """Gives back the arguments it ran with (a re-published task's must be the caller's)."""
    _work(self, hang)
    return [list(args), kwargs]


@app.task(name="effect.work", bind=True)
def effect_work(self: Task, hang: list[float] | None = None) -> str:
    return _work(self, hang)


_ledger: list[Any] = []


@app.task(name="ledger.charge", bind=True)
def ledger_charge(self: Task, hang_after: str = "fetch", hang: list[float] | None = None
                  ) -> str:
    """fetch (idempotent), charge (effectful), notify (pure), through the step ledger."""
    from reconciler.ledger import Step, StepLedger  # noqa: PLC0415 - only this task needs it

    if not _ledger:
        _ledger.append(StepLedger(_database))
    job, attempt = self.request.id, self.request.retries + 1
    plan = [Step("fetch", "idempotent"), Step("charge", "effectful"), Step("notify", "pure")]
    run = _ledger[0].run("celery", job, attempt, plan)
    mark(f"{job}-pending-{attempt}-{','.join(map(str, run.pending()))}")
    for index in run.pending():
        with run.step(index):
            mark(f"{job}-step-{plan[index].step_name}-{attempt}")
        if plan[index].step_name == hang_after:
            pause(hang, attempt)
    mark(f"{job}-done-{attempt}")
    return "charged"


HOLD_PREFIX = "conformance:hold:"
"""While the key ``HOLD_PREFIX + <task id>`` exists in the broker's Redis, ``conformance.hold``
keeps running (a test's Redis is emptied for the next one, which ends it)."""


@app.task(name="conformance.hold", bind=True, track_started=False, ignore_result=True)
def conformance_hold(self: Task) -> None:
    """Holds its request, and so its task id, in a live worker's process without writing
    the result row: the conformance suite's live owner of a row it wrote itself."""
    import redis  # noqa: PLC0415 - the broker is Redis

    client = redis.Redis.from_url(os.environ["SOURCES_BROKER_URL"])
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and client.exists(HOLD_PREFIX + self.request.id):
        time.sleep(0.1)
