"""What an operator reads about Celery tasks (issue 25): ``jobs explain``, ``jobs list``,
``jobs show`` and ``reconciler kinds`` under a Celery ``[source]``, and the console's job
page and kind filter; on SQLite and PostgreSQL.

Rows are written as Celery's database backend writes them (its own table object): with
``result_extended`` (name, args, worker, queue), or without it (a ``STARTED`` row with
nothing but its id, status and result). The console is the one ``reconciler run`` serves,
assembled by the composition root, read through its own routing.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.config.loader import load_config, pass_config
from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.vocabulary import EffectKind
from reconciler.root.console import assemble_console
from reconciler.sources.celery import CeleryConfig
from tests.conformance.celery import CeleryFixture
from tests.sources.celery_support import (  # noqa: F401 - fixtures, found by name
    CeleryProject,
    celery_live_worker,
    celery_project,
    declare_queues,
    django_celery_project,
    redis_server,
    redis_url,
)
from tests.sources.support import reconcile_once
from tests.sources.test_operator_commands import cli, cli_json


def _config(tmp_path: Path, project: CeleryProject, *kinds: str) -> Path:
    """A config file as the docs' Celery example, with these ``[kinds]`` tables."""
    lines = [f"database_url = {project.engine.url.render_as_string(hide_password=False)!r}",
             "[source]", 'kind = "celery"', f"broker_url = {project.broker_url!r}",
             *kinds]
    path = tmp_path / "reconciler.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _forget(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM reconciliation_decisions"))


def _row(project: CeleryProject, status: str, name: str | None, *,
         task_id: str | None = None) -> str:
    """A result row as Celery's backend writes it: with ``result_extended`` when it has a
    name, else only what a backend without it stores."""
    from celery.backends.database.models import Task, TaskExtended  # noqa: PLC0415

    task_id = task_id or str(uuid.uuid4())
    values: dict[str, Any] = {"task_id": task_id, "status": status, "result": json.dumps(
        {"pid": 1, "hostname": "w@tests"}).encode()}
    if name is None:
        table = Task.__table__
    else:
        table = TaskExtended.__table__
        values |= {"name": name, "args": b"[]", "kwargs": b"{}", "worker": "w@tests",
                   "retries": 0, "queue": "celery"}
    with project.engine.begin() as conn:
        conn.execute(table.insert().values(**values))
    return task_id


class TestCommandLine:
    """``reconciler jobs ...`` and ``reconciler kinds`` as an operator types them."""

    def test_explain_on_a_row_without_result_extended_names_the_missing_setting(
            self, celery_project: CeleryProject, tmp_path: Path,  # noqa: F811
            capsys: pytest.CaptureFixture[str]) -> None:
        """A STARTED row without a task name is processing but cannot be judged: explain
        says so and names result_extended, with the exit code of a job it does not apply
        to (6), never "is processing, not processing"."""
        path = _config(tmp_path, celery_project)
        task_id = _row(celery_project, "STARTED", None)
        code, out, err = cli(capsys, path, "jobs", "explain", task_id)
        assert (code, out) == (6, "")
        assert "not processing" not in err
        assert f"job {task_id} is processing but cannot be judged" in err
        assert "result_extended = True" in err
        assert "task_track_started = True" in err

    def test_kinds_never_warns_about_a_catch_all_and_counts_unnamed_rows(
            self, celery_project: CeleryProject, tmp_path: Path,  # noqa: F811
            capsys: pytest.CaptureFixture[str]) -> None:
        """With nothing running, ``[kinds."*"]`` draws no spelling warning; two STARTED
        rows without a name are counted, with the setting they miss."""
        path = _config(tmp_path, celery_project, '[kinds."*"]', "max_attempts = 2")
        code, out, err = cli(capsys, path, "kinds")
        assert (code, err) == (0, "")
        assert "warning" not in out
        for _ in range(2):
            _row(celery_project, "STARTED", None)
        code, out, _ = cli(capsys, path, "kinds")
        assert code == 0
        assert "spelling" not in out
        assert ("warning: 2 running job(s) have no kind, so no pattern applies and no pass "
                "judges them (result_extended is missing)") in out
        unnamed = cli_json(capsys, path, "kinds")["unnamed_running"]
        assert (unnamed["count"], unnamed["missing_setting"]) == (2, "result_extended")

    def test_jobs_list_is_newest_first_in_aligned_columns(
            self, celery_project: CeleryProject, tmp_path: Path,  # noqa: F811
            capsys: pytest.CaptureFixture[str]) -> None:
        """Rows written one after another are listed newest first, whatever their task
        ids' order; each column starts where its header does."""
        path = _config(tmp_path, celery_project)
        written = [_row(celery_project, status, name, task_id=f"{letter * 8}-0000-4000-8000-"
                        f"{letter * 12}")
                   for letter, status, name in (("c", "SUCCESS", "app.reports.monthly"),
                                                ("b", "FAILURE", "app.charge"),
                                                ("a", "STARTED", "app.mail"))]
        listed = [j["job_id"] for j in cli_json(capsys, path, "jobs", "list")]
        assert listed == list(reversed(written))
        code, out, _ = cli(capsys, path, "jobs", "list")
        assert code == 0
        header, *lines = out.splitlines()
        assert [line.split()[0] for line in lines] == list(reversed(written))
        for line, kind in zip(lines, ("app.mail", "app.charge", "app.reports.monthly"),
                              strict=True):
            assert line.index(kind) == header.index("KIND")
            status = line.split()[2]
            assert line.index(status, header.index("KIND")) == header.index("STATUS")

    def test_show_on_a_failed_task_claims_no_resume_step(
            self, celery_project: CeleryProject, tmp_path: Path,  # noqa: F811
            capsys: pytest.CaptureFixture[str]) -> None:
        """A FAILURE task will not run again: neither ``jobs show`` nor its JSON names a
        step it resumes at; a STARTED one still does."""
        path = _config(tmp_path, celery_project)
        failed = _row(celery_project, "FAILURE", "app.charge")
        started = _row(celery_project, "STARTED", "app.mail")
        code, out, _ = cli(capsys, path, "jobs", "show", failed)
        assert code == 0
        assert "failed [FAILURE in celery]" in out
        assert "resumes at step" not in out
        assert cli_json(capsys, path, "jobs", "show", failed)["resume_step_index"] is None
        code, out, _ = cli(capsys, path, "jobs", "show", started)
        assert "resumes at step 0" in out

    def test_attempts_on_celerys_table_are_its_retries_plus_one_or_unknown(
            self, celery_project: CeleryProject, tmp_path: Path,  # noqa: F811
            capsys: pytest.CaptureFixture[str]) -> None:
        """A row with ``retries = 2`` (result_extended) shows attempts 3; a row written
        without result_extended keeps no count and shows it unknown, not 1."""
        path = _config(tmp_path, celery_project, '[kinds."*"]', "max_attempts = 4")
        counted = _row(celery_project, "FAILURE", "app.charge")
        with celery_project.engine.begin() as conn:
            conn.execute(sa.text("UPDATE celery_taskmeta SET retries = 2 WHERE task_id = :id"),
                         {"id": counted})
        uncounted = _row(celery_project, "STARTED", None)
        shown = {j["job_id"]: j["attempts_used"] for j in cli_json(capsys, path, "jobs", "list")}
        assert shown == {counted: 3, uncounted: None}
        assert "attempts 3/4" in cli(capsys, path, "jobs", "show", counted)[1]
        assert "attempts ?/4" in cli(capsys, path, "jobs", "show", uncounted)[1]

    def test_attempts_on_django_celery_results_are_unknown(
            self, django_celery_project: CeleryProject, tmp_path: Path,  # noqa: F811
            capsys: pytest.CaptureFixture[str]) -> None:
        """django-celery-results' ``TaskResult`` keeps no retry count (its ``meta`` keeps
        only the children): ``jobs list``, ``jobs show`` and the console show the task's
        attempts as unknown, never a made-up 1."""
        project = django_celery_project
        path = _config(tmp_path, project, f'result_table = "{project.table}"',
                       '[kinds."*"]', "max_attempts = 3")
        task_id = str(uuid.uuid4())
        with project.engine.begin() as conn:
            # As the backend's ``_store_result`` writes a failure with result_extended.
            conn.execute(sa.text(
                f"INSERT INTO {project.table} (task_id, status, task_name, task_args, "
                "task_kwargs, worker, content_type, content_encoding, result, date_created, "
                "date_done, traceback, meta) VALUES (:id, 'FAILURE', 'app.charge', "
                "'\"()\"', '\"{}\"', 'w@tests', 'application/json', 'utf-8', "
                "'{\"exc_type\": \"ValueError\"}', :now, :now, 'Traceback', "
                "'{\"children\": []}')"), {"id": task_id, "now": datetime.now(UTC)})
        [listed] = cli_json(capsys, path, "jobs", "list")
        assert (listed["job_id"], listed["attempts_used"]) == (task_id, None)
        code, out, _ = cli(capsys, path, "jobs", "list")
        assert code == 0
        assert " ?/3 " in out.splitlines()[1]
        assert cli_json(capsys, path, "jobs", "show", task_id)["attempts_used"] is None
        assert "attempts ?/3" in cli(capsys, path, "jobs", "show", task_id)[1]
        status, page = _page(path, f"/jobs/celery/{task_id}")
        assert status == 200
        assert "attempts ?/3" in page


def _page(path: Path, target: str) -> tuple[int, str]:
    """One console page as ``reconciler run --config path`` serves it."""
    config = load_config(path)
    console = assemble_console(config, pass_config(config.settings, "console-test",
                                                   config.kinds))
    try:
        reply = console.handle("GET", target, {})
    finally:
        console.close()
    return reply.status, reply.body.decode()


class TestConsole:
    """The console's job page and decision list under a Celery source."""

    def test_the_job_page_shows_a_listed_task_without_decisions(
            self, celery_project: CeleryProject, tmp_path: Path,  # noqa: F811
            capsys: pytest.CaptureFixture[str]) -> None:
        """A task ``jobs list`` shows processing has a page: its name and Celery's own
        status, though no pass decided anything about it."""
        path = _config(tmp_path, celery_project)
        _forget(celery_project.engine)
        task_id = _row(celery_project, "STARTED", "app.reports.build")
        assert [j["status"] for j in cli_json(capsys, path, "jobs", "list")] == ["processing"]
        status, body = _page(path, f"/jobs/celery/{task_id}")
        assert status == 200
        assert '<strong class="kind">app.reports.build</strong>' in body
        assert '<strong class="status">processing</strong>' in body
        assert '<span class="source-status">STARTED</span> in celery' in body
        assert "w@tests" not in body  # never a worker's name

    def test_a_decision_keeps_the_task_name_for_the_kind_column_and_filter(
            self, celery_project: CeleryProject, celery_live_worker: str,  # noqa: F811
            tmp_path: Path) -> None:
        """A real pass fails a dead worker's task: the decision lists its task name as
        its kind, ``kind=app.*`` finds it (``other.*`` does not), and its job page shows
        the name and Celery's FAILURE."""
        path = _config(tmp_path, celery_project)
        _forget(celery_project.engine)
        tasks = CeleryFixture(celery_project.engine, celery_project.broker_url,
                              celery_live_worker)
        worker = f"dead-{uuid.uuid4().hex[:8]}@tests"
        declare_queues(celery_project.broker_url, "celery")  # as the app's workers do
        task_id = tasks._started("app.payments.charge", worker)
        tasks._dead_worker(task_id)
        kinds = KindRules([KindRule("idem.*", effect=EffectKind.IDEMPOTENT)],
                          stale_after_seconds=0.5, wedged_after_seconds=3600.0,
                          max_attempts=3)
        config = CeleryConfig(broker_url=celery_project.broker_url)
        [outcome] = reconcile_once(celery_project.engine, config, kinds)
        assert (outcome.job_id, outcome.applied) == (task_id, True)
        status, listing = _page(path, "/decisions?kind=app.*")
        assert status == 200
        assert f"/jobs/celery/{task_id}" in listing
        assert '<td class="kind">app.payments.charge</td>' in listing
        assert f"/jobs/celery/{task_id}" not in _page(path, "/decisions?kind=other.*")[1]
        status, page = _page(path, f"/jobs/celery/{task_id}")
        assert status == 200
        assert '<strong class="kind">app.payments.charge</strong>' in page
        assert '<span class="source-status">FAILURE</span> in celery' in page
        assert worker not in page
        # Evidence in the words JSON and `jobs explain` use; no "generation 0 -> 0" (a
        # generation is this project's own jobs' counter, which Celery's rows do not have).
        assert "<td>True</td>" not in page
        assert "<td>False</td>" not in page
        assert "<td>true</td>" in page or "<td>false</td>" in page
        assert "generation" not in page


DOCS = Path(__file__).parents[2] / "docs" / "sources.md"
APP = '''from celery import Celery

app = Celery("proj", broker={broker!r}, backend={backend!r})
app.conf.update(task_track_started=True, result_extended=True, result_serializer="json")
'''


def test_the_documented_command_creates_celerys_table_before_db_upgrade(
        tmp_path: Path, redis_url: str,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    """On a new SQLite file, ``db upgrade`` under a Celery source refuses (Celery makes its
    table on first use); the command docs/sources.md gives, run as written against an app
    named ``proj.celery``, creates it, and ``db upgrade`` then succeeds."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    [command] = [line.split("#")[0].strip() for line in DOCS.read_text().splitlines()
                 if line.startswith('python -c "from proj.celery import app')]
    url = f"sqlite:///{tmp_path / 'results.db'}"
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    (tmp_path / "proj" / "celery.py").write_text(
        APP.format(broker=redis_url, backend=f"db+{url}"))
    path = tmp_path / "reconciler.toml"
    path.write_text(f'database_url = {url!r}\n[source]\nkind = "celery"\n'
                    f"broker_url = {redis_url!r}\n")
    code, _, err = cli(capsys, path, "db", "upgrade")
    assert code == 2
    assert "table 'celery_taskmeta' not found" in err
    # Refused before anything was made: none of this project's tables is left behind.
    made = sa.create_engine(url)
    try:
        assert sa.inspect(made).get_table_names() == []
    finally:
        made.dispose()
    argv = [sys.executable, "-c", command.removeprefix('python -c "').removesuffix('"')]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    code, out, err = cli(capsys, path, "db", "upgrade")
    assert (code, err) == (0, "")
    # The refused upgrade left nothing behind: this one made the schema.
    assert "created this project's schema" in out
