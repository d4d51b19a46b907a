"""The project's commands, each a process of its own: ``migrate`` (django-celery-results'
migrations), and ``result ID`` which prints, as JSON, what the caller's
``AsyncResult(ID).get()`` gives through django-celery-results (``value``, or ``raised``:
the exception's type and message), with this project's package made unimportable first: a
Django project that does not install the reconciler reads the same.
"""

from __future__ import annotations

import json
import os
import sys


def _result(task_id: str, timeout: float) -> dict[str, object]:
    sys.modules["reconciler"] = None  # type: ignore[assignment] - unimportable from here on
    from tests.sources.celery_app import app  # noqa: PLC0415 - after django.setup()

    result = app.AsyncResult(task_id)
    try:
        return {"value": result.get(timeout=timeout), "state": result.state}
    except Exception as raised:
        return {"raised": f"{type(raised).__name__}: {raised}", "state": result.state}


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.sources.celery_django.settings")
    os.environ["SOURCES_RESULTS"] = "django-db"
    command = sys.argv[1:]
    if command and command[0] == "result":
        import django  # noqa: PLC0415

        django.setup()
        print(json.dumps(_result(command[1], float(command[2]))))
        return
    from django.core.management import execute_from_command_line  # noqa: PLC0415

    execute_from_command_line([sys.argv[0], *command])


if __name__ == "__main__":
    main()
