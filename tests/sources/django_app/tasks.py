"""The test project's tasks. Each writes marker files (``<id>-started-<attempt>``,
``<id>-done-<attempt>``) and sleeps ``hang[attempt - 1]`` seconds on the attempts the list
covers (default: the first, an hour), so a test can kill or stop its worker mid-task.
``ledger_charge`` records its three steps through the step ledger
(``SOURCES_DATABASE_URL``) and sleeps after the step named ``hang_after``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tests.sources.django_app.framework import TaskContext, task


def mark(name: str) -> None:
    """Leave a marker file the test waits for."""
    (Path(os.environ["SOURCES_MARKERS"]) / name).write_text(str(os.getpid()))


def pause(hang: list[float] | None, attempt: int) -> None:
    """Sleep as long as ``hang`` says for this attempt (1-based; default: the first, an
    hour)."""
    seconds = [3600.0] if hang is None else hang
    if attempt - 1 < len(seconds):
        time.sleep(seconds[attempt - 1])


def _work(context: TaskContext, hang: list[float] | None) -> str:
    job, attempt = context.task_result.id, context.attempt
    mark(f"{job}-started-{attempt}")
    pause(hang, attempt)
    mark(f"{job}-done-{attempt}")
    return f"done on attempt {attempt}"


@task(takes_context=True)
def idem_work(context: TaskContext, hang: list[float] | None = None) -> str:
    """Safe to run again from the start."""
    return _work(context, hang)


@task(takes_context=True)
def pure_work(context: TaskContext, hang: list[float] | None = None) -> str:
    """No effect outside its result (the chaos runs' third kind)."""
    return _work(context, hang)


@task(takes_context=True)
def effect_work(context: TaskContext, hang: list[float] | None = None) -> str:
    """Not safe to run twice (the default effect)."""
    return _work(context, hang)


_ledger: list[Any] = []


@task(takes_context=True)
def ledger_charge(context: TaskContext, hang_after: str = "fetch",
                  hang: list[float] | None = None) -> str:
    """fetch (idempotent), charge (effectful), notify (pure), through the step ledger."""
    from reconciler.ledger import Step, StepLedger  # noqa: PLC0415 - only this task needs it

    if not _ledger:
        _ledger.append(StepLedger(os.environ["SOURCES_DATABASE_URL"]))
    job, attempt = context.task_result.id, context.attempt
    plan = [Step("fetch", "idempotent"), Step("charge", "effectful"), Step("notify", "pure")]
    run = _ledger[0].run("django-tasks", job, attempt, plan)
    mark(f"{job}-pending-{attempt}-{','.join(map(str, run.pending()))}")
    for index in run.pending():
        with run.step(index):
            mark(f"{job}-step-{plan[index].step_name}-{attempt}")
        if plan[index].step_name == hang_after:
            pause(hang, attempt)
    mark(f"{job}-done-{attempt}")
    return "charged"
