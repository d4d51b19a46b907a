"""`reconciler jobs list|show` on Django's tasks and Celery, through their own tables.

On django-tasks-db's task results and Celery's ``celery_taskmeta`` (SQLite and
PostgreSQL): a running task is processing with its system's own status, a failed one
shows our reason code (read from the traceback the reconciler wrote, never the task's own)
and the decision about it; an operator command these sources do not take is refused in
one line naming the source.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.vocabulary import EffectKind
from reconciler.sources.celery import CeleryConfig
from tests.sources.celery_support import (  # noqa: F401 - fixtures, found by name
    CeleryProject,
    celery_project,
    redis_server,
    redis_url,
)
from tests.sources.django_tasks_support import (  # noqa: F401 - fixtures, found by name
    DjangoDatabase,
    DjangoTasksFactory,
    django_db,
)
from tests.sources.support import reconcile_once
from tests.sources.test_operator_commands import cli, cli_json, config_file, forget_decisions

KINDS = KindRules([KindRule("idem.*", effect=EffectKind.IDEMPOTENT),
                   KindRule("*", max_run_seconds=60.0)],
                  stale_after_seconds=60.0, wedged_after_seconds=3600.0, max_attempts=3)


class TestDjangoTasks:
    """Task results as django-tasks-db's backend writes them."""

    def test_show_and_list(self, django_db: DjangoDatabase, tmp_path: Path,  # noqa: F811
                           capsys: pytest.CaptureFixture[str]) -> None:
        """A RUNNING task is processing with its claims as attempts; a READY one is
        queued; the status filter picks one."""
        tasks = DjangoTasksFactory(django_db)
        path = config_file(tmp_path, tasks.engine, tasks.config)
        forget_decisions(tasks.engine, tasks.source_name)
        running, waiting = tasks.live("idem.report"), tasks.queued("idem.mail")
        shown = cli_json(capsys, path, "jobs", "show", running)
        assert (shown["job_id"], shown["job_kind"], shown["status"]) == (
            running, "idem.report", "processing")
        assert (shown["source_status"], shown["attempts_used"]) == ("RUNNING", 1)
        assert shown["created_at"] is not None
        listed = cli_json(capsys, path, "jobs", "list")
        assert {j["job_id"]: j["status"] for j in listed} == {
            running: "processing", waiting: "queued"}
        assert [j["job_id"] for j in cli_json(capsys, path, "jobs", "list", "--status",
                                              "queued")] == [waiting]

    def test_a_failed_task_shows_our_reason_only(
            self, django_db: DjangoDatabase, tmp_path: Path,  # noqa: F811
            capsys: pytest.CaptureFixture[str]) -> None:
        """A pass fails a dead worker's effectful task: show names our reason and the
        decision; a task's own traceback is never shown."""
        tasks = DjangoTasksFactory(django_db)
        path = config_file(tmp_path, tasks.engine, tasks.config)
        forget_decisions(tasks.engine, tasks.source_name)
        ours, own = tasks.died("charge"), tasks.queued("mail")
        tasks._update(own, status="FAILED", exception_class_path="app.Boom",
                      traceback="Traceback ...\napp.Boom: card 4242 declined\n")
        [outcome] = reconcile_once(tasks.engine, tasks.config, KINDS)
        shown = cli_json(capsys, path, "jobs", "show", ours)
        assert (shown["status"], shown["source_status"]) == ("failed", "FAILED")
        assert shown["reason"] == outcome.reason.value
        assert [d["disposition"] for d in shown["decisions"]] == ["terminalize"]
        code, out, _ = cli(capsys, path, "jobs", "show", own)
        assert code == 0
        assert "4242" not in out
        assert cli_json(capsys, path, "jobs", "show", own)["reason"] is None

    def test_hold_from_the_command_line(self, django_db: DjangoDatabase,  # noqa: F811
                                        tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
        """Applied, saying the workers are not stopped; again, refused in one line (exit
        6); the task as it was."""
        tasks = DjangoTasksFactory(django_db)
        path = config_file(tmp_path, tasks.engine, tasks.config)
        job = tasks.live("idem.report")
        code, out, err = cli(capsys, path, "jobs", "hold", job)
        assert code == 0, err
        assert "workers are not stopped" in out
        try:
            code, out, err = cli(capsys, path, "jobs", "hold", job)
            assert (code, out, err.count("\n")) == (6, "", 1)
            assert f"cannot hold job {job}: already_held" in err
            assert tasks.status(job) == "running"
        finally:
            assert cli(capsys, path, "jobs", "unhold", job)[0] == 0


class TestCelery:
    """Result rows as a Celery worker writes them (``task_track_started``,
    ``result_extended``)."""

    @staticmethod
    def _row(project: CeleryProject, status: str, name: str, *, retries: int = 0,
             traceback: str | None = None) -> str:
        from celery.backends.database.models import TaskExtended  # noqa: PLC0415

        task_id = str(uuid.uuid4())
        with project.engine.begin() as conn:
            conn.execute(TaskExtended.__table__.insert().values(
                task_id=task_id, status=status, name=name, args=b"[]", kwargs=b"{}",
                worker="w@tests", retries=retries, queue="celery", traceback=traceback,
                result=json.dumps({"pid": 1, "hostname": "w@tests"}).encode()))
        return task_id

    def test_show_and_list(self, celery_project: CeleryProject, tmp_path: Path,  # noqa: F811
                           capsys: pytest.CaptureFixture[str]) -> None:
        """STARTED is processing (attempts: retries + 1), a FAILURE row shows no reason of
        its own, a retry of a running task is refused in one line."""
        config = CeleryConfig(broker_url=celery_project.broker_url)
        path = config_file(tmp_path, celery_project.engine, config)
        with celery_project.engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM reconciliation_decisions"))
        started = self._row(celery_project, "STARTED", "idem.report", retries=1)
        failed = self._row(celery_project, "FAILURE", "app.charge",
                           traceback="app.Boom: card 4242 declined\n")
        shown = cli_json(capsys, path, "jobs", "show", started)
        assert (shown["status"], shown["source_status"], shown["attempts_used"]) == (
            "processing", "STARTED", 2)
        listed = {j["job_id"]: (j["status"], j["reason"])
                  for j in cli_json(capsys, path, "jobs", "list")}
        assert listed == {started: ("processing", None), failed: ("failed", None)}
        code, out, _ = cli(capsys, path, "jobs", "show", failed)
        assert code == 0
        assert "4242" not in out
        code, _, err = cli(capsys, path, "jobs", "retry", started, "--note", "n")
        assert code == 6
        assert f"cannot retry job {started}: job_not_failed_or_cancelled" in err
