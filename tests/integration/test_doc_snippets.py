"""The snippets docs/sources.md shows, run as a reader would paste them: every Python block
compiles, the step ledger's generic example records its steps in a real database, the
Django 5.2 settings start Django with the backport and django-tasks-db, and the Django
ledger example runs as a task of that project."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa

from reconciler.storage.engines import create_engine

SOURCES_DOC = Path(__file__).resolve().parents[2] / "docs" / "sources.md"


def python_blocks() -> list[str]:
    """Every ```python block of docs/sources.md."""
    return re.findall(r"```python\n(.*?)```", SOURCES_DOC.read_text(), re.DOTALL)


def block_with(text: str) -> str:
    """The one Python block holding ``text``."""
    [block] = [b for b in python_blocks() if text in b]
    return block


def test_every_python_block_compiles() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 5
    for block in blocks:
        compile(block, "docs/sources.md", "exec")


def _ledger_rows(url: str) -> list[tuple[str, str, str]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(  # type: ignore[misc]
                "SELECT source_name, job_key, step_state FROM step_ledger_entries "
                "ORDER BY step_index"))]
    finally:
        engine.dispose()


def _run(script: str, tmp_path: Path, **env: str) -> None:
    """``script`` in a fresh interpreter (as the reader's worker would run it)."""
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", **env},
                          check=False)
    assert done.returncode == 0, done.stderr


def test_the_generic_ledger_example_records_its_steps(tmp_path: Path,
                                                     db_url: str) -> None:
    """``StepLedger()`` reads the database from the worker's environment, as the comment
    says; ``handle`` records both steps succeeded."""
    snippet = block_with('def handle(job_id: str, attempt: int)')
    _run(snippet + "\nhandle('job-1', 1)\n", tmp_path, RECONCILER_DATABASE_URL=db_url)
    assert _ledger_rows(db_url) == [("procrastinate", "job-1", "succeeded")] * 2


def test_the_django_52_settings_and_ledger_example_run_in_a_django_project(
        tmp_path: Path, db_url: str) -> None:
    """The Django 5.2 settings shown (the backport and django-tasks-db) configure Django;
    the ledger example, its import switched to the backport as its comment says, runs as a
    task of that project through the immediate backend and records its steps."""
    pytest.importorskip("django_tasks")
    settings = block_with("# settings.py (Django 5.2)").replace("...,", "")
    ledger = block_with("def send_invoice(context, invoice_id)").replace(
        "from django.tasks import task", "from django_tasks import task")
    (tmp_path / "docs_settings.py").write_text(settings + textwrap.dedent(f"""
        DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3",
                                  "NAME": {str(tmp_path / 'django.db')!r}}}}}
        USE_TZ = True
        SECRET_KEY = "docs-snippet"
        # The example's task run at enqueue, so the test needs no db_worker.
        TASKS = {{"default": {{"BACKEND": "django_tasks.backends.immediate.ImmediateBackend"}}}}
    """))
    (tmp_path / "docs_tasks.py").write_text(ledger)
    _run("import django; django.setup()\n"
         "from django.conf import settings\n"
         "assert settings.INSTALLED_APPS == ['django_tasks', 'django_tasks_db']\n"
         "import docs_tasks\n"
         "result = docs_tasks.send_invoice.enqueue(7)\n"
         "assert result.status == 'SUCCESSFUL', result.status\n"
         "print(result.id)\n",
         tmp_path, DJANGO_SETTINGS_MODULE="docs_settings", PYTHONPATH=str(tmp_path),
         RECONCILER_DATABASE_URL=db_url)
    rows = _ledger_rows(db_url)
    assert [(source, state) for source, _, state in rows] == [
        ("django-tasks", "succeeded")] * 2
