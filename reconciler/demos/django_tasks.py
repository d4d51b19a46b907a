"""``reconciler demo --source django-tasks``: a real django-tasks-db worker is SIGKILLed
mid-task, and one pass recovers its tasks the Django way.

On a fresh SQLite file (removed at the end): the reconciler's tables, then Django's own
``migrate`` (the django-tasks-db backend's table beside them), two tasks enqueued through
Django's own API, one ``db_worker`` that takes both and is killed. Once the tasks' declared
``max_run_seconds`` has passed (the backend keeps no heartbeat), a pass (configured as a
config file with ``[source] kind = "django-tasks"`` would configure it) makes the idempotent
task ``READY`` again and fails the effectful one; a new ``db_worker`` then finishes the
first, and Django's own result API reads the second's failure.

Without Django and the django-tasks packages (``pip install django django-tasks
django-tasks-db``) it says so in one line and exits 2.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from reconciler.demos.support import (
    MissingPrerequisiteError,
    demo_config,
    pass_until_decided,
    say,
    wait,
)
from reconciler.root.migrations import migrate

MAX_RUN_SECONDS = 2.0
TASKS = "reconciler.demos.django_tasks_app"
# Every task may run MAX_RUN_SECONDS (the backend keeps no heartbeat); the report is safe
# to run again.
KINDS = {f"{TASKS}.*": {"max_run_seconds": MAX_RUN_SECONDS},
         f"{TASKS}.render_report": {"effect": "idempotent"}}
SETTINGS_MODULE = "reconciler.demos.django_settings"


def run_django_tasks_demo() -> int:
    """The demo; 0 when the killed worker's tasks were recovered as the table says."""
    missing = [p for p in ("django", "django_tasks", "django_tasks_db")
               if importlib.util.find_spec(p) is None]
    if missing:
        raise MissingPrerequisiteError(
            f"the Django tasks demo needs {', '.join(missing)}: pip install 'django>=5.2,<6' "
            "django-tasks django-tasks-db")
    folder = Path(tempfile.mkdtemp(prefix="reconciler-demo-django-"))
    try:
        return _demo(folder / "project.db")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _demo(path: Path) -> int:
    url = f"sqlite:///{path}"
    os.environ.update(DEMO_DJANGO_DB=str(path), DJANGO_SETTINGS_MODULE=SETTINGS_MODULE)
    import django  # noqa: PLC0415 - optional, checked above
    from django.core.management import call_command  # noqa: PLC0415

    config = demo_config(source={"kind": "django-tasks"}, kinds=KINDS, database_url=url,
                         stale_after_seconds=1.0)
    django.setup()
    try:
        call_command("migrate", verbosity=0)
        migrate(config)  # the reconciler's tables; the backend's table is there to check
        say("Django's migrate and the reconciler's tables are in one SQLite file")
        from django_tasks import default_task_backend  # noqa: PLC0415

        from reconciler.demos import django_tasks_app  # noqa: PLC0415 - needs django.setup()

        render = django_tasks_app.render_report.enqueue().id
        charge = django_tasks_app.charge_card.enqueue().id
        say(f"enqueued {render} (render_report, configured idempotent) and {charge} "
            "(charge_card, effectful by default)")

        def status(task_id: str) -> str:
            return str(default_task_backend.get_result(task_id).status)

        argv = [sys.executable, "-m", "django", "db_worker", "--queue-name", "*",
                "--interval", "0.1", "--no-startup-delay", "--no-reload", "-v0"]
        # A db_worker runs one task at a time: two workers, one task each, both killed.
        first = [subprocess.Popen(argv, env=os.environ.copy(), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for _ in range(2)]
        second: subprocess.Popen[bytes] | None = None
        try:
            wait(lambda: {status(render), status(charge)} == {"RUNNING"},
                 "the workers to take both tasks")
            for worker in first:
                worker.send_signal(signal.SIGKILL)
                worker.wait(timeout=10)
            say("both db_workers SIGKILLed mid-task: both tasks stay RUNNING in Django")
            if not pass_until_decided(config, {render, charge}, "max_run_seconds "
                                      f"{MAX_RUN_SECONDS:g} s from started_at"):
                return 1
            second = subprocess.Popen(argv, env=os.environ.copy(), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            wait(lambda: status(render) == "SUCCESSFUL",
                 "a new db_worker to finish the resumed task")
            failed = default_task_backend.get_result(charge)
            error = failed.errors[-1]
            say(f"a new db_worker finished {render}: SUCCESSFUL "
                f"({default_task_backend.get_result(render).return_value!r})")
            say(f"{charge} stays {failed.status}; Django reads errors[-1].exception_class = "
                f"{error.exception_class.__name__}, "
                f"{error.traceback.strip().splitlines()[-1]!r}")
            ok = status(render) == "SUCCESSFUL" and str(failed.status) == "FAILED"
            return 0 if ok else 1
        finally:
            for process in (*first, second):
                if process is not None and process.poll() is None:
                    process.kill()
                    process.wait(timeout=10)
    finally:
        from django.db import connections  # noqa: PLC0415 - optional, checked above

        connections.close_all()
