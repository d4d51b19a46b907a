"""The test project's commands, run as a process of its own (``python -m
tests.sources.django_app.manage migrate``, ``db_worker``, ``enqueue``, ``result``).

``enqueue TASK [JSON-KWARGS]`` prints the new task's id; ``enqueue-many`` reads a JSON list
of ``{"task", "kwargs", "delay"}`` on stdin and prints one id a line, each task due
``delay`` seconds from now (the chaos run's jobs); ``result ID`` prints what Django's
own result API says of it, as JSON, with this project's package made unimportable first: a
Django project that does not install the reconciler reads the same.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from types import ModuleType


def _result(task_id: str) -> dict[str, object]:
    sys.modules["reconciler"] = None  # type: ignore[assignment] - unimportable from here on
    from tests.sources.django_app.framework import (  # noqa: PLC0415 - after django.setup()
        FRAMEWORK,
        default_task_backend,
    )

    result = default_task_backend.get_result(task_id)
    errors = [{"exception_class": f"{e.exception_class.__module__}."
                                  f"{e.exception_class.__qualname__}",
               "traceback": e.traceback} for e in result.errors]
    return_value = result.return_value if result.status == "SUCCESSFUL" else None
    return {"framework": FRAMEWORK, "status": str(result.status), "attempts": result.attempts,
            "errors": errors, "return_value": return_value,
            "finished": result.finished_at is not None}


def _enqueue_many(tasks: ModuleType) -> None:
    from django.utils import timezone  # noqa: PLC0415 - after django.setup()

    now = timezone.now()
    for job in json.load(sys.stdin):
        due = now + timedelta(seconds=job["delay"])
        print(getattr(tasks, job["task"]).using(run_after=due).enqueue(**job["kwargs"]).id)


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.sources.django_app.settings")
    command = sys.argv[1:]
    if command and command[0] in ("enqueue", "enqueue-many", "result"):
        import django  # noqa: PLC0415

        django.setup()
        if command[0] == "result":
            print(json.dumps(_result(command[1])))
            return
        from tests.sources.django_app import tasks  # noqa: PLC0415

        if command[0] == "enqueue-many":
            _enqueue_many(tasks)
            return
        kwargs = json.loads(command[2]) if len(command) > 2 else {}
        print(getattr(tasks, command[1]).enqueue(**kwargs).id)
        return
    from django.core.management import execute_from_command_line  # noqa: PLC0415

    execute_from_command_line([sys.argv[0], *command])


if __name__ == "__main__":
    main()
