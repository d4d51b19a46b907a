"""The tasks of the ``reconciler demo --source django-tasks`` project. Each hangs on its first
attempt (so the demo can SIGKILL the worker mid-task) and returns at once on a later one."""

from __future__ import annotations

import time

from django_tasks import TaskContext, task


def _work(context: TaskContext) -> str:
    if context.attempt == 1:
        time.sleep(3600)
    return f"done on attempt {context.attempt}"


@task(takes_context=True)
def render_report(context: TaskContext) -> str:
    """Configured idempotent in the demo: resumed."""
    return _work(context)


@task(takes_context=True)
def charge_card(context: TaskContext) -> str:
    """Configured by nobody, so effectful: failed, never run twice."""
    return _work(context)
