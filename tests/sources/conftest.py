"""Real job systems beside the reconciler, on the suite's throwaway PostgreSQL.

One database per session holds the reconciler's own tables and each system's schema, as in
production (the foreign tables live in the reconciler's database):
Procrastinate's applied once into schema ``procrastinate``, graphile-worker's and pg-boss's
migrated once by their own code into ``graphile_worker`` and ``pgboss``. Every test starts
from empty job tables.

npm packages (graphile-worker, pg-boss) are installed once into a cached folder with
``npm install --no-audit --no-fund``. Without node or npm those tests are skipped with a
reason, except under ``CI=true``, where that is a failure.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import StepLedgerEntry
from reconciler.storage.engines import create_engine
from tests.conftest import ENGINES, REPO_ROOT, MariaDBForTests, PostgresForTests
from tests.helpers import fresh_database
from tests.pg_server import INSTALL_HINT
from tests.sources.support import processes  # noqa: F401 - a fixture of this folder

GRAPHILE_WORKER_VERSION = "0.17.3"
PG_BOSS_VERSION = "10.4.2"  # the newest pg-boss that runs on Node 20 (11+ needs Node 22)
NODE_HINT = ("node and npm (Node 20) are needed for graphile-worker and pg-boss: "
             "apt-get install nodejs npm")
PROCRASTINATE_SCHEMA = "procrastinate"
GRAPHILE_SCHEMA = "graphile_worker"
PGBOSS_SCHEMA = "pgboss"
NODE_DIR = Path(__file__).resolve().parent / "node"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def unavailable(reason: str) -> None:
    """Skip with the reason, or fail under CI=true."""
    if in_ci():
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/sources" in str(item.path):
            item.add_marker(pytest.mark.integration)


@dataclass(frozen=True)
class SourcesDatabase:
    """The session's database for real job systems, beside the reconciler's own tables."""

    url: str
    libpq: str
    engine: Engine

    def conninfo(self, search_path: str | None = None) -> str:
        """A libpq URL, optionally with a search path (as a system's workers connect)."""
        if search_path is None:
            return self.libpq
        return f"{self.libpq}?options=-csearch_path%3D{search_path}"

    def execute(self, sql: str, params: dict[str, object] | None = None) -> list[sa.Row[object]]:
        """Run SQL in its own transaction; the rows it returns."""
        with self.engine.begin() as conn:
            result = conn.execute(sa.text(sql), params or {})
            return list(result) if result.returns_rows else []


@pytest.fixture(scope="session")
def sources_db(postgres: PostgresForTests | None) -> Iterator[SourcesDatabase]:
    """A migrated database of the session's PostgreSQL, for every real-system test."""
    if postgres is None:
        unavailable(f"PostgreSQL not available: {INSTALL_HINT}")
        return
    name = postgres.new_database(migrated=True)
    url = postgres.url(name)
    parts = postgres.parts
    libpq = (f"postgresql://{parts.get('user', 'postgres')}@{parts.get('host', '127.0.0.1')}:"
             f"{parts.get('port', '5432')}/{name}")
    engine = create_engine(url)
    try:
        yield SourcesDatabase(url, libpq, engine)
    finally:
        engine.dispose()
        postgres.drop(name)


@pytest.fixture(scope="session")
def mariadb_sources_db(mariadb: MariaDBForTests) -> Iterator[SourcesDatabase]:
    """A migrated database of the session's MariaDB, for the real systems that run there
    (Django's tasks, Celery's result tables): as ``sources_db``, its URL for both."""
    name = mariadb.new_database(migrated=True)
    url = mariadb.server.url(name)
    engine = create_engine(url)
    try:
        yield SourcesDatabase(url, url, engine)
    finally:
        engine.dispose()
        mariadb.server.drop_database(name)


def clear_ledger(db: SourcesDatabase) -> None:
    """Forget every step ledger record (job ids restart with each test)."""
    with db.engine.begin() as conn:
        conn.execute(sa.delete(StepLedgerEntry.__table__))


def empty_for_a_test(db: SourcesDatabase, table: str) -> None:
    """The system's ``table`` truncated, the step ledger and the audit emptied: job ids
    restart with each test, and attempts counted from the audit start at none."""
    db.execute(f"TRUNCATE {table}")
    clear_ledger(db)
    with db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM reconciliation_decisions"))
        conn.execute(sa.text("DELETE FROM reconciliation_passes"))


@contextmanager
def sqlite_copy(template: Path, folder: Path) -> Iterator[tuple[str, Engine]]:
    """A copy of a migrated SQLite ``template`` in ``folder``: its URL and an engine on it,
    disposed afterwards."""
    path = folder / "project.db"
    shutil.copyfile(template, path)
    url = f"sqlite:///{path}"
    engine = create_engine(url)
    try:
        yield url, engine
    finally:
        engine.dispose()


# --------------------------------------------------------------------------- #
# Procrastinate
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="session")
def procrastinate_schema(sources_db: SourcesDatabase) -> str:
    """Procrastinate's own schema SQL, applied once into its own PostgreSQL schema."""
    try:
        from procrastinate.schema import SchemaManager  # noqa: PLC0415 - optional (peers)
    except ImportError:
        unavailable("Procrastinate is not installed: pip install -e '.[peers]'")
        raise
    with psycopg.connect(sources_db.libpq, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {PROCRASTINATE_SCHEMA}")  # type: ignore[arg-type]
        conn.execute(f"SET search_path TO {PROCRASTINATE_SCHEMA}")  # type: ignore[arg-type]
        conn.execute(SchemaManager.get_schema())
    return PROCRASTINATE_SCHEMA


@pytest.fixture
def procrastinate_db(sources_db: SourcesDatabase, procrastinate_schema: str
                     ) -> SourcesDatabase:
    """The session database with Procrastinate's tables emptied for this test."""
    sources_db.execute(
        f"TRUNCATE {procrastinate_schema}.procrastinate_jobs, "
        f"{procrastinate_schema}.procrastinate_events, "
        f"{procrastinate_schema}.procrastinate_periodic_defers, "
        f"{procrastinate_schema}.procrastinate_workers RESTART IDENTITY CASCADE")
    clear_ledger(sources_db)
    return sources_db


# --------------------------------------------------------------------------- #
# Node: graphile-worker and pg-boss
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """graphile-worker and pg-boss installed from npm, once, into a cached folder."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        unavailable(NODE_HINT)
    folder = (Path(tempfile.gettempdir()) / "reconciler-test-npm" /
              f"graphile-worker-{GRAPHILE_WORKER_VERSION}-pg-boss-{PG_BOSS_VERSION}")
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / ".lock").open("w") as lock:
        # Sessions running side by side install once.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _installed(folder):
            (folder / "package.json").write_text(json.dumps({"private": True}))
            done = subprocess.run(
                [str(npm), "install", "--no-audit", "--no-fund", "--loglevel=error",
                 f"graphile-worker@{GRAPHILE_WORKER_VERSION}", f"pg-boss@{PG_BOSS_VERSION}"],
                cwd=folder, capture_output=True, text=True, timeout=300, check=False)
            if done.returncode != 0 or not _installed(folder):
                pytest.fail(f"npm install failed: {done.stderr.strip()[-500:]}", pytrace=False)
    return folder / "node_modules"


def _installed(folder: Path) -> bool:
    def version(package: str) -> str | None:
        manifest = folder / "node_modules" / package / "package.json"
        return json.loads(manifest.read_text())["version"] if manifest.exists() else None

    return (version("graphile-worker") == GRAPHILE_WORKER_VERSION
            and version("pg-boss") == PG_BOSS_VERSION)


def node_env(node_modules: Path, db: SourcesDatabase, markers: Path) -> dict[str, str]:
    """The environment of a node worker script."""
    return {"NODE_PATH": str(node_modules), "SOURCES_PG_CONNINFO": db.libpq,
            "SOURCES_MARKERS": str(markers)}


def run_node(script: str, node_modules: Path, db: SourcesDatabase, *args: str) -> str:
    """Run a node script of tests/sources/node to completion; its output."""
    node = shutil.which("node")
    assert node is not None
    done = subprocess.run(
        [node, str(NODE_DIR / script), *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, **node_env(node_modules, db, Path(tempfile.gettempdir()))},
        cwd=REPO_ROOT, check=False)
    if done.returncode != 0:
        pytest.fail(f"node {script} failed: {done.stderr.strip()[-800:]}", pytrace=False)
    return done.stdout


@pytest.fixture(scope="session")
def graphile_schema(node_modules: Path, sources_db: SourcesDatabase) -> str:
    """graphile-worker's schema, migrated by graphile-worker itself."""
    run_node("graphile_worker_runner.js", node_modules, sources_db, "migrate")
    return GRAPHILE_SCHEMA


@pytest.fixture
def graphile_db(sources_db: SourcesDatabase, graphile_schema: str) -> SourcesDatabase:
    """The session database with graphile-worker's jobs and queues emptied for this test."""
    sources_db.execute(f"TRUNCATE {graphile_schema}._private_jobs, "
                       f"{graphile_schema}._private_job_queues RESTART IDENTITY")
    clear_ledger(sources_db)
    return sources_db


@pytest.fixture(scope="session")
def pgboss_schema(node_modules: Path, sources_db: SourcesDatabase) -> str:
    """pg-boss's schema, created by pg-boss itself on its first start."""
    run_node("pgboss_runner.js", node_modules, sources_db, "migrate")
    return PGBOSS_SCHEMA


@pytest.fixture
def pgboss_db(sources_db: SourcesDatabase, pgboss_schema: str) -> SourcesDatabase:
    """The session database with pg-boss's jobs emptied for this test."""
    sources_db.execute(f"TRUNCATE {pgboss_schema}.job, {pgboss_schema}.archive")
    clear_ledger(sources_db)
    return sources_db


# --------------------------------------------------------------------------- #
# The reconciler's own database on both engines, cheaply
# --------------------------------------------------------------------------- #


@pytest.fixture(params=ENGINES)
def reconciler_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """The reconciler's migrated database on each engine: a fresh SQLite file, the
    session's PostgreSQL database with the step ledger emptied (no database per test), or
    a fresh MariaDB database (made ahead in the background)."""
    if request.param == "mariadb":
        mariadb: MariaDBForTests = request.getfixturevalue("mariadb")
        name = mariadb.new_database(migrated=True)
        engine = create_engine(mariadb.server.url(name))
        try:
            yield engine
        finally:
            engine.dispose()
            mariadb.server.drop_database(name)
        return
    if request.param == "sqlite":
        engine = create_engine(fresh_database(tmp_path, "reconciler.db"))
        try:
            yield engine
        finally:
            engine.dispose()
        return
    db: SourcesDatabase = request.getfixturevalue("sources_db")
    clear_ledger(db)
    yield db.engine


# The Django project's fixtures (tests/sources/django_tasks_support.py), found by name.
from tests.sources.celery_support import (  # noqa: E402, F401 - it imports this module
    celery_live_worker,
    celery_project,
    django_celery_project,
    django_celery_results_mariadb_schema,
    django_celery_results_schema,
    django_celery_sqlite_template,
    redis_server,
    redis_url,
)
from tests.sources.django_tasks_support import (  # noqa: E402, F401 - it imports this module
    django_db,
    django_sqlite_template,
    django_tasks_mariadb_schema,
    django_tasks_schema,
)
