"""A user's own SQLite file under a mapped table: the reconciler changes nothing persistent
about the file (its journal mode stays the user's), and the read-only commands work on a
read-only open of it. Only a file the reconciler creates itself is switched to WAL."""

from __future__ import annotations

import sqlite3
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.integration

CONFIG = """
    [source]
    kind = "table"
    table = "app_jobs"
    id_column = "id"
    status_column = "state"
    processing = "running"
    queued = "ready"
    failed = "dead"
    kind_column = "job_type"
    activity_column = "touched_at"

    [kinds."mail.*"]
    effect = "idempotent"
    max_run_seconds = 30
"""


def journal_mode(path: Path) -> str:
    with sqlite3.connect(path) as conn:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0])


@pytest.fixture
def app_file(tmp_path: Path) -> tuple[Path, Path]:
    """The app's own SQLite file (rollback journal, as SQLite makes it) with one job that
    died ten minutes ago, and a config mapping it."""
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE app_jobs (id INTEGER PRIMARY KEY, job_type TEXT, "
                     "state TEXT NOT NULL, touched_at TEXT)")
        conn.execute("INSERT INTO app_jobs (job_type, state, touched_at) VALUES "
                     "('mail.send', 'running', strftime('%Y-%m-%d %H:%M:%f', 'now', "
                     "'-600 seconds'))")
    config = tmp_path / "reconciler.toml"
    config.write_text(textwrap.dedent(CONFIG))
    return path, config


def test_no_command_changes_the_journal_mode_of_a_file_it_did_not_create(
        app_file: tuple[Path, Path]) -> None:
    """A refused dry run (no schema yet) and ``db upgrade`` leave the app's journal mode."""
    path, config = app_file
    url = f"sqlite:///{path}"
    refused = run_cli(url, "pass", "--dry-run", "--config", str(config))
    assert refused.returncode != 0
    assert journal_mode(path) == "delete"
    upgraded = run_cli(url, "db", "upgrade", "--config", str(config))
    assert upgraded.returncode == 0, upgraded.stderr
    assert journal_mode(path) == "delete"


def test_the_read_only_commands_work_on_a_read_only_open_of_the_file(
        app_file: tuple[Path, Path]) -> None:
    """After ``db upgrade``, ``pass --dry-run``, ``jobs explain`` and ``decisions`` run on
    the file opened read-only (SQLite's ``mode=ro``), and see the job."""
    path, config = app_file
    assert run_cli(f"sqlite:///{path}", "db", "upgrade", "--config",
                   str(config)).returncode == 0
    read_only_url = f"sqlite:///file:{path}?mode=ro&uri=true"
    preview = run_cli(read_only_url, "pass", "--dry-run", "--config", str(config))
    assert preview.returncode == 0, preview.stderr
    assert "job 1: resume (resumed_idempotent_step)" in preview.stdout
    explained = run_cli(read_only_url, "jobs", "explain", "1", "--config", str(config))
    assert explained.returncode == 0, explained.stderr
    assert "resumed_idempotent_step" in explained.stdout
    listed = run_cli(read_only_url, "decisions", "--config", str(config))
    assert listed.returncode == 0, listed.stderr


def test_a_file_the_reconciler_creates_is_its_own_and_uses_wal(tmp_path: Path) -> None:
    """``db upgrade`` on a path with nothing there makes the reconciler's own embedded
    database, in WAL mode (readers never block the writer)."""
    path = tmp_path / "reconciler.db"
    assert run_cli(f"sqlite:///{path}", "db", "upgrade").returncode == 0
    assert journal_mode(path) == "wal"


def test_a_status_value_the_tables_check_forbids_is_refused_by_db_upgrade_and_pass(
        tmp_path: Path) -> None:
    """``queued = "pendng"`` against ``CHECK (state IN (...))``: one line naming it, from
    ``db upgrade --config`` and from every command that starts on the config."""
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE app_jobs (id INTEGER PRIMARY KEY, job_type TEXT, "
                     "state TEXT NOT NULL CHECK (state IN ('running', 'ready', 'dead')), "
                     "touched_at TEXT)")
    config = tmp_path / "reconciler.toml"
    config.write_text(textwrap.dedent(CONFIG).replace('queued = "ready"', 'queued = "pendng"'))
    url = f"sqlite:///{path}"
    upgraded = run_cli(url, "db", "upgrade", "--config", str(config))
    assert upgraded.returncode != 0
    assert upgraded.stderr.strip().count("\n") == 0
    assert "queued = 'pendng'" in upgraded.stderr
    config.write_text(textwrap.dedent(CONFIG))
    assert run_cli(url, "db", "upgrade", "--config", str(config)).returncode == 0
    config.write_text(textwrap.dedent(CONFIG).replace('queued = "ready"', 'queued = "pendng"'))
    refused = run_cli(url, "pass", "--config", str(config))
    assert refused.returncode != 0
    assert "queued = 'pendng'" in refused.stderr
