"""What the command line imports before it does anything: ``--help`` and a usage error
import no adapter, database driver or validation library, a config imports only the
source it names, and a read command on SQLite imports only what reading SQLite needs
(each run in a fresh interpreter, whose modules are then listed)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from reconciler.config.registry import REGISTRY

# The keys a [source] kind requires (the others' defaults are enough).
REQUIRED = {
    "table": 'table = "jobs"\nid_column = "id"\nstatus_column = "status"\n'
             'processing = "running"\nqueued = "queued"\nfailed = "failed"\n',
    "celery": 'broker_url = "redis://r:6379/0"\n',
    "rq": 'redis_url = "redis://r:6379/0"\n',
    "dramatiq": 'redis_url = "redis://r:6379/0"\n',
}
HEAVY = ("sqlalchemy", "psycopg", "pydantic", "pydantic_settings", "alembic", "models",
         "reconciler.storage", "reconciler.sources", "reconciler.root")


def modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds once ``code`` ran (no config file of ours)."""
    listing = "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECONCILER_")}
    done = subprocess.run([sys.executable, "-c", code + listing], env=env, check=True,
                          capture_output=True, text=True, timeout=60)
    return set(json.loads(done.stdout.splitlines()[-1]))


def heavy(found: set[str], among: tuple[str, ...] = HEAVY) -> list[str]:
    return sorted(m for m in found
                  if any(m == h or m.startswith(f"{h}.") for h in among))


@pytest.mark.parametrize("argv", [["--help"], ["jobs"], ["jobs", "list", "--help"],
                                  ["demo", "--source", "nope"]])
def test_help_and_usage_errors_import_nothing_heavy(argv: list[str]) -> None:
    """They end in the argument parser: no storage, source, driver or pydantic."""
    code = (f"import contextlib, io\nfrom reconciler.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()), "
            f"contextlib.redirect_stderr(io.StringIO()):\n"
            f"    try:\n        main({argv!r})\n    except SystemExit:\n        pass")
    assert heavy(modules_after(code)) == []


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.kind)
def test_a_config_imports_only_the_source_it_names(tmp_path: Path, entry: object) -> None:
    """Loading ``[source] kind = X`` imports X's module and no other source's."""
    from reconciler.config.registry import SourceEntry  # noqa: PLC0415

    assert isinstance(entry, SourceEntry)
    others = {e.module for e in REGISTRY if e.module != entry.module}
    path = tmp_path / "reconciler.toml"
    path.write_text(f'[source]\nkind = "{entry.kind}"\n{REQUIRED.get(entry.kind, "")}')
    found = modules_after(f"from reconciler.config.loader import load_config\n"
                          f"load_config({str(path)!r})")
    assert entry.config.partition(":")[0] in found
    assert sorted(others & found) == []


# What a read command on SQLite never needs: the PostgreSQL driver, the migrations, the
# sidecar's scheduler, metrics, console and templates, the worker, any foreign source or
# demo, and the settings library pydantic-settings (the settings read RECONCILER_* alone).
NOT_FOR_READING_SQLITE = (
    "psycopg", "psycopg_binary", "pydantic_settings", "alembic", "apscheduler",
    "prometheus_client", "jinja2", "reconciler.sidecar", "reconciler.console",
    "reconciler.worker", "reconciler.root.sidecar", "reconciler.root.console",
    "reconciler.root.worker", "reconciler.storage.answering", "reconciler.storage.wakeups",
    "reconciler.storage.console_views", "reconciler.demos.",
    *sorted({e.module for e in REGISTRY if e.kind != "native"}),
)
READ_COMMANDS = [["jobs", "list"], ["jobs", "list", "--json"], ["jobs", "show", "1"],
                 ["jobs", "explain", "1"], ["decisions"], ["kinds"]]


class Run(NamedTuple):
    code: int
    stderr: str
    modules: set[str]
    mappers_configured: bool


def run_command(argv: list[str], database: Path) -> Run:
    """``reconciler ARGV`` on ``database`` in a fresh interpreter: its exit code, what it
    wrote on stderr, the modules it imported, and whether the ORM configured its mappers
    (the models declare the tables; reading them needs no mapper configuration)."""
    code = (f"import contextlib, io, json, sys\nfrom reconciler.cli import main\n"
            f"err = io.StringIO()\n"
            f"with contextlib.redirect_stdout(io.StringIO()), "
            f"contextlib.redirect_stderr(err):\n    code = main({argv!r})\n"
            f"found = sorted(sys.modules)\n"
            f"import models\n"
            f"configured = any(m.configured for m in models.Base.registry.mappers)\n"
            f"print(json.dumps([code, err.getvalue(), found, configured]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECONCILER_")}
    env["RECONCILER_DATABASE_URL"] = f"sqlite:///{database}"
    done = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                          capture_output=True, text=True, timeout=60)
    code_, stderr, found, configured = json.loads(done.stdout.splitlines()[-1])
    return Run(code_, stderr, set(found), configured)


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database at this release's schema, made as an operator makes it."""
    path = tmp_path_factory.mktemp("startup") / "reconciler.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECONCILER_")}
    subprocess.run([sys.executable, "-m", "reconciler.cli", "db", "upgrade",
                    "--database-url", f"sqlite:///{path}"], env=env, check=True,
                   capture_output=True, timeout=120)
    return path


@pytest.mark.parametrize("argv", READ_COMMANDS, ids=" ".join)
def test_a_read_command_on_sqlite_imports_only_what_reading_needs(
        argv: list[str], database: Path) -> None:
    """No PostgreSQL driver, migrations, sidecar, console, worker or foreign source, and
    no ORM mapper configuration: Core statements over the models' tables."""
    run = run_command(argv, database)
    # 0, or the answer about the empty database (no job 1: 5; explain: 5 as well).
    assert run.code in (0, 5), run.stderr
    assert heavy(run.modules, NOT_FOR_READING_SQLITE) == []
    assert not run.mappers_configured


def test_an_old_schema_is_still_one_line_and_exit_4(tmp_path: Path, database: Path) -> None:
    """An old revision is named in one line. Only then are the migration scripts read
    (whether the revision is older or newer than this release's), so Alembic is allowed."""
    old = tmp_path / "old.db"
    old.write_bytes(database.read_bytes())
    with sqlite3.connect(old) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0001'")
    run = run_command(["jobs", "list"], old)
    assert run.code == 4
    assert run.stderr.count("\n") == 1
    assert "schema is at revision 0001" in run.stderr
    assert heavy(run.modules, tuple(m for m in NOT_FOR_READING_SQLITE if m != "alembic")) == []


def test_no_database_file_is_one_line_and_exit_4(tmp_path: Path) -> None:
    """A missing SQLite file is named, not created, with no driver of PostgreSQL loaded."""
    missing = tmp_path / "absent.db"
    run = run_command(["decisions"], missing)
    assert (run.code, run.stderr.count("\n")) == (4, 1)
    assert "no database at" in run.stderr
    assert not missing.exists()
    assert heavy(run.modules, NOT_FOR_READING_SQLITE) == []
