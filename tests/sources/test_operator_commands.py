"""`reconciler jobs list|show|hold|unhold|retry|cancel` through the configured source.

On the real Procrastinate, graphile-worker and pg-boss schemas (PostgreSQL) and on a mapped
home-grown table (SQLite and PostgreSQL): a job the source has is shown with its system's
status, kind and attempts and our decisions about it, never "no job"; an operator command
the source does not take is refused in one line naming the source.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.cli import main
from reconciler.config.tables import SourceSettings
from reconciler.sources.table.config import TableConfig
from tests.sources.factories import (
    GraphileWorkerFactory,
    PgBossFactory,
    ProcrastinateFactory,
    SystemFactory,
)
from tests.sources.support import reconcile_once
from tests.sources.test_foreign_sources import SYSTEMS, kind_rules
from tests.sources.test_table_source import KINDS as TABLE_KINDS
from tests.sources.test_table_source import Home, add, dead
from tests.sources.test_table_source import home as home  # noqa: PLC0414 - a fixture

RUNNING = {"procrastinate": "doing", "graphile-worker": "locked", "pg-boss": "active"}
"""A running job's status in each system's own words."""


def config_file(tmp_path: Path, engine: Engine, source: SourceSettings) -> Path:
    """A config file naming the database and the source, as an operator would write it."""
    lines = [f"database_url = {engine.url.render_as_string(hide_password=False)!r}",
             "[source]", f"kind = {source.kind!r}"]
    for key in source.file_keys()[1:]:
        value = getattr(source, key)
        if value is not None:
            lines.append(f"{key} = {value!r}")
    lines += ['[kinds."idem.*"]', 'effect = "idempotent"']
    path = tmp_path / "reconciler.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def forget_decisions(engine: Engine, source_name: str) -> None:
    """The session's database keeps every test's audit, and an emptied job table hands out
    its ids again: earlier tests' decisions about "job 1" are not this test's."""
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM reconciliation_decisions WHERE job_source = :s"),
                     {"s": source_name})


def cli(capsys: pytest.CaptureFixture[str], path: Path, *argv: str) -> tuple[int, str, str]:
    """The command line, in this process: (exit status, stdout, stderr)."""
    code = main([*argv, "--config", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys: pytest.CaptureFixture[str], path: Path, *argv: str) -> Any:
    code, out, err = cli(capsys, path, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(params=SYSTEMS)
def system(request: pytest.FixtureRequest) -> SystemFactory:
    """Each real system's fixture factory, on empty job tables."""
    if request.param == "procrastinate":
        return ProcrastinateFactory(request.getfixturevalue("procrastinate_db"),
                                    request.getfixturevalue("procrastinate_schema"))
    if request.param == "graphile-worker":
        return GraphileWorkerFactory(request.getfixturevalue("graphile_db"),
                                     request.getfixturevalue("graphile_schema"))
    return PgBossFactory(request.getfixturevalue("pgboss_db"),
                         request.getfixturevalue("pgboss_schema"))


class TestRealSystems:
    """Procrastinate, graphile-worker and pg-boss jobs, read through their own tables."""

    def test_show_and_list_read_the_systems_jobs(self, system: SystemFactory, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
        """A running job is processing with its system's own status and attempts; a
        queued one is queued; both are listed, and a status filter picks one."""
        path = config_file(tmp_path, system.db.engine, system.config)
        forget_decisions(system.db.engine, system.source_name)
        running, waiting = system.live("idem.report"), system.queued("idem.mail")
        shown = cli_json(capsys, path, "jobs", "show", str(running))
        assert (shown["job_id"], shown["job_kind"], shown["status"]) == (
            running, "idem.report", "processing")
        assert shown["source_status"] == RUNNING[system.source_name]
        assert shown["attempts_used"] == system.attempts_used(running)
        assert shown["decisions"] == []
        listed = cli_json(capsys, path, "jobs", "list")
        assert {j["job_id"]: j["status"] for j in listed} == {
            running: "processing", waiting: "queued"}
        assert [j["job_id"] for j in cli_json(capsys, path, "jobs", "list", "--status",
                                              "queued")] == [waiting]

    def test_our_decisions_about_the_job_are_shown(self, system: SystemFactory,
                                                   tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
        """After a pass resumed a dead worker's job, show names the decision and the job's
        status in its system's words."""
        path = config_file(tmp_path, system.db.engine, system.config)
        forget_decisions(system.db.engine, system.source_name)
        job = system.died("idem.report")
        reconcile_once(system.db.engine, system.config, kind_rules())
        shown = cli_json(capsys, path, "jobs", "show", str(job))
        assert shown["status"] == "queued"
        [decision] = shown["decisions"]
        assert decision["disposition"] == "resume"
        code, out, _ = cli(capsys, path, "jobs", "show", str(job))
        assert code == 0
        # The decision with the step it resumed at, as every line that shows one says it.
        step = decision["resume_step_index"]
        assert f"decided: resume at step {step} ({decision['reason']})" in out

    def test_a_job_the_source_lacks_is_named_with_the_source(
            self, system: SystemFactory, tmp_path: Path,
            capsys: pytest.CaptureFixture[str]) -> None:
        """No such job: one line naming the source, exit 5."""
        path = config_file(tmp_path, system.db.engine, system.config)
        missing = "0b5f5c3e-4d5e-4b8a-9a51-2d1b9e4c7a10" if system.source_name == "pg-boss" \
            else "987654"
        code, _, err = cli(capsys, path, "jobs", "show", missing)
        assert code == 5
        assert f"no {system.source_name} job with id {missing}" in err


class TestMappedTable:
    """A home-grown table, on SQLite and PostgreSQL (the reported defect: `jobs show 1`,
    `jobs list` and `jobs hold 10` read the empty native job_runs)."""

    def test_show_list_and_hold(self, home: Home, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
        """The table's jobs are shown and listed; a hold is the reconciler's own, shown
        with the job and its record."""
        path = config_file(tmp_path, home.engine, home.full)
        running = add(home, lease_in=300, activity_ago=1)
        waiting = add(home, status="pending", job_type="mail", attempts=0)
        shown = cli_json(capsys, path, "jobs", "show", str(running))
        assert (shown["job_id"], shown["job_kind"], shown["status"],
                shown["source_status"], shown["attempts_used"]) == (
            running, "idem.report", "processing", "processing", 1)
        listed = cli_json(capsys, path, "jobs", "list")
        assert [(j["job_id"], j["status"]) for j in listed] == [
            (waiting, "queued"), (running, "processing")]
        code, out, err = cli(capsys, path, "jobs", "hold", str(running), "--as", "dana",
                             "--note", "<b>looking</b>")
        assert code == 0, err
        assert "workers are not stopped" in out
        try:
            shown = cli_json(capsys, path, "jobs", "show", str(running))
            assert shown["operator_hold"] is True
            assert [(h["type"], h.get("action"), h.get("actor"), h.get("note"))
                    for h in shown["history"]] == [
                ("action", "hold", "dana", "<b>looking</b>")]
        finally:
            assert cli(capsys, path, "jobs", "unhold", str(running))[0] == 0

    def test_a_failed_job_shows_our_reason_and_decision(
            self, home: Home, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """The reason column holds our reason code after a pass ended the attempt (a job
        without a plan is failed); show gives the status, the reason and the decision."""
        path = config_file(tmp_path, home.engine, home.full)
        forget_decisions(home.engine, home.full.kind)
        job = dead(home, job_type="idem.report")
        reconcile_once(home.engine, home.full, TABLE_KINDS)
        shown = cli_json(capsys, path, "jobs", "show", str(job))
        [decision] = shown["decisions"]
        assert (shown["status"], shown["source_status"]) == ("failed", "failed")
        assert decision["disposition"] == "terminalize"
        assert shown["reason"] == decision["reason"]

    def test_the_tables_own_error_text_is_never_shown(
            self, home: Home, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """A reason column the application also writes messages into: only our codes show."""
        path = config_file(tmp_path, home.engine, home.full)
        job = add(home, status="failed", status_reason="card 4111 declined for bob@example.com")
        shown = cli_json(capsys, path, "jobs", "show", str(job))
        assert shown["reason"] is None
        assert "bob" not in json.dumps(cli_json(capsys, path, "jobs", "list"))

    def test_a_text_id_reaches_the_table(self, home: Home, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
        """An id that is not a number names no job of an integer-keyed table: exit 5."""
        path = config_file(tmp_path, home.engine, home.full)
        code, _, err = cli(capsys, path, "jobs", "show", "job-7")
        assert code == 5
        assert "no table job with id job-7" in err


def test_the_minimal_mapping_lists_too(home: Home, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Fewer columns mapped: no attempts column, so none are counted."""
    mapping: TableConfig = home.minimal
    path = config_file(tmp_path, home.engine, mapping)
    job = add(home)
    [listed] = cli_json(capsys, path, "jobs", "list")
    assert (listed["job_id"], listed["job_kind"], listed["attempts_used"]) == (
        job, "idem.report", 0)
