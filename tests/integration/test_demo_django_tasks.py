"""``reconciler demo --source django-tasks``: a real django-tasks-db worker killed, its tasks
recovered by one pass, on a SQLite file the demo makes itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

DEMO = ["reconciler", "demo", "--source", "django-tasks"]


def demo(*blocked: str) -> subprocess.CompletedProcess[str]:
    """The demo in a process of its own, with ``blocked`` packages made unimportable."""
    body = (f"import sys; sys.modules.update(dict.fromkeys({list(blocked)!r})); "
            f"sys.argv = {DEMO!r}; from reconciler.cli import main; sys.exit(main())")
    return subprocess.run([sys.executable, "-c", body], capture_output=True, text=True,
                          timeout=180, check=False, env=os.environ.copy())


def test_the_killed_workers_tasks_are_recovered_the_django_way() -> None:
    """The idempotent task is READY again and finished by a new db_worker; the effectful
    one is FAILED, and Django's own result API reads our reason."""
    pytest.importorskip("django_tasks_db", reason="pip install -e '.[test]'")
    done = demo()
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "both db_workers SIGKILLed mid-task" in out
    assert "resume (resumed_idempotent_step)" in out
    assert "terminalize (worker_died_mid_step)" in out
    assert "SUCCESSFUL ('done on attempt 2')" in out
    assert ("stays FAILED; Django reads errors[-1].exception_class = RuntimeError, "
            "'RuntimeError: worker_died_mid_step'") in out


def test_without_the_django_packages_it_says_so_in_one_line_and_exits_2() -> None:
    """One line naming what is missing; no traceback."""
    done = demo("django_tasks_db")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "django_tasks_db" in lines[0]
    assert "Traceback" not in done.stderr
