"""Shared fixtures: every integration test runs on SQLite and on PostgreSQL, and the tests
marked ``every_engine`` on MariaDB too.

PostgreSQL comes from ``RECONCILER_TEST_PG_DSN`` (a libpq ``host=... port=... user=...``
string) when set, else from a throwaway server this session starts itself
(tests/pg_server.py); MariaDB from a throwaway server too (tests/mariadb_server.py), started
by the first test that needs it. Without an engine's binaries its half is skipped with an
install hint, except under ``CI=true``, where that is a failure.

``EVERY_ENGINE_MODULES`` (marked ``every_engine`` at collection) are the modules whose SQL
differs by engine; the rest (the CLI, the console, the service, explain around them) reach
the database only through the operations these test, so a third engine would rerun the
same statements. ``RECONCILER_TEST_ENGINES`` (``sqlite,postgresql,mariadb`` by default)
chooses the engines; named explicitly, every test runs on each engine named, marked or not
(.ci/run runs the rest on MariaDB that way).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import Engine

from reconciler.config.settings import Settings
from reconciler.storage.engines import create_engine
from reconciler.storage.schema import upgrade
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient
from tests import rewrite_cache, system_packages
from tests.cli_runner import run_main, settings_env
from tests.fork_server import run_script
from tests.helpers import fresh_database, require_mariadb_bin, require_pg_bin
from tests.pg_server import DSN_ENV, INSTALL_HINT, ThrowawayPostgres, find_pg_bin
from tests.statement_cache import share as share_compiled_statements

# Before any test makes an engine: see tests/statement_cache.py.
share_compiled_statements()

ENGINES_CHOSEN = bool(os.environ.get("RECONCILER_TEST_ENGINES"))
ENGINES: tuple[str, ...] = (tuple(os.environ["RECONCILER_TEST_ENGINES"].split(","))
                            if ENGINES_CHOSEN else ("sqlite", "postgresql", "mariadb"))
REPO_ROOT = Path(__file__).resolve().parent.parent
EVERY_ENGINE_MODULES = frozenset({
    # The lease contract and the worker runtime: claims (SKIP LOCKED), fences by affected
    # rows, the database clock, sessions, deadlocks retried, the schema and its migrations.
    "integration/test_worker_protocol.py", "integration/test_worker_runtime.py",
    "integration/test_crash_recovery.py", "integration/test_artifacts.py",
    "integration/test_migrations.py", "integration/test_mysql_deadlocks.py",
    "integration/test_mysql_sessions.py",
    # The pass and its chores: the candidate scan, the swap, the audit, replicas side by
    # side, the brake, retention, operator actions, and what a pass costs in statements.
    "integration/test_pass.py", "integration/test_replicas.py",
    "integration/test_native_brake.py", "integration/test_stuck_work.py",
    "integration/test_job_retention.py", "integration/test_operator_actions.py",
    "integration/test_pass_cost.py", "integration/test_config_wiring.py",
    # The operators' chunked bulk actions (one UPDATE over a chunk's JSON rows) and the
    # read model every view of a job goes through (the audit's newest moves per job).
    "integration/test_bulk_chunks.py", "conformance/test_views_agree.py",
    # The foreign sources MySQL carries, with their real workers, and every source's
    # conformance cases.
    "sources/test_table_source.py", "sources/test_table_actions.py",
    "sources/test_django_tasks_workers.py", "sources/test_django_tasks_actions.py",
    "sources/test_celery_workers.py", "conformance/test_source_conformance.py",
    "conformance/test_registry_coverage.py",
    # The state machine (its MariaDB class) and the short chaos run.
    "statemachine/test_store_machine.py", "chaos/test_chaos_short.py",
})


class PostgresForTests:
    """A PostgreSQL server for this session, with a migrated template for fast databases.

    Each test gets a fresh copy of the template. The next copy is made in the background
    while a test runs, and a finished test's database is dropped there too, so a test
    waits for neither (about 0.1 s each, more on a busy machine, on every PostgreSQL test).
    """

    def __init__(self, dsn: str, server: ThrowawayPostgres | None) -> None:
        self.dsn = dsn
        self.server = server
        self.parts = dict(p.split("=", 1) for p in dsn.split())
        # One template per test session: sessions may share a server (a developer's, CI's).
        self.template = f"reconciler_template_{uuid.uuid4().hex[:8]}"
        self._template_ready = False
        self._file_copy: bool | None = None
        # One thread: the template is made once, copies and drops never overlap it.
        self._background = ThreadPoolExecutor(1, thread_name_prefix="test-databases")
        self._copies: deque[Future[str]] = deque()
        self._drops: list[Future[None]] = []

    def url(self, name: str) -> str:
        host = self.parts.get("host", "127.0.0.1")
        port = self.parts.get("port", "5432")
        user = self.parts.get("user", "postgres")
        if host.startswith("/"):
            return f"postgresql+psycopg://{user}@/{name}?host={host}&port={port}"
        return f"postgresql+psycopg://{user}@{host}:{port}/{name}"

    def admin(self, sql: str) -> None:
        with psycopg.connect(self.dsn + " dbname=postgres", autocommit=True) as conn:
            conn.execute(sql)  # type: ignore[arg-type]

    def new_database(self, *, migrated: bool) -> str:
        """A new database of this test's own: empty, or a copy of the migrated template."""
        if not migrated:
            name = "t_" + uuid.uuid4().hex[:12]
            self.admin(f"CREATE DATABASE {name}")
            return name
        if not self._copies:
            self._copies.append(self._background.submit(self._copy_template))
        name = self._copies.popleft().result()
        self._copies.append(self._background.submit(self._copy_template))
        return name

    def _copy_template(self) -> str:
        if not self._template_ready:
            self.admin(f"CREATE DATABASE {self.template}")
            engine = create_engine(self.url(self.template))
            upgrade(engine)
            engine.dispose()
            self._template_ready = True
        name = "t_" + uuid.uuid4().hex[:12]
        self.admin(f"CREATE DATABASE {name} TEMPLATE {self.template}{self._strategy()}")
        return name

    def _strategy(self) -> str:
        """PostgreSQL 15's default copies a template page by page through the WAL; a
        file copy of the suite's small template costs the server half the CPU (a
        checkpoint with ``fsync`` off is cheap). Older servers know only the file copy."""
        if self._file_copy is None:
            with psycopg.connect(self.dsn + " dbname=postgres") as conn:
                self._file_copy = conn.info.server_version >= 150000
        return " STRATEGY FILE_COPY" if self._file_copy else ""

    def drop(self, name: str) -> None:
        """Drop a test's database (in the background: the next test need not wait)."""
        self._drops = [done for done in self._drops if not done.done() or done.exception()]
        self._drops.append(self._background.submit(
            self.admin, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))

    def close(self) -> None:
        """Drop what is left (the unused copy, the template); raise a failed drop."""
        for copy in self._copies:
            if copy.exception() is None:
                self.drop(copy.result())
        if self._template_ready:
            self.drop(self.template)
        self._background.shutdown(wait=True)
        for done in self._drops:
            done.result()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresForTests | None]:
    """The session's PostgreSQL, or None (skip) when it cannot be had outside CI."""
    dsn = os.environ.get(DSN_ENV)
    if dsn:
        shared = PostgresForTests(dsn, None)
        yield shared
        shared.close()
        return
    if find_pg_bin() is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but PostgreSQL is unavailable: {INSTALL_HINT}", pytrace=False)
        yield None
        return
    with ThrowawayPostgres() as server:
        shared = PostgresForTests(server.dsn, server)
        yield shared
        shared.close()


@pytest.fixture
def own_postgres() -> Iterator[ThrowawayPostgres]:
    """A PostgreSQL server of the test's own, which it may restart and stop (never the
    session's shared one)."""
    require_pg_bin()
    with ThrowawayPostgres() as server:
        yield server


class MariaDBForTests:
    """The session's MariaDB: a migrated database made ahead in the background."""

    def __init__(self) -> None:
        from tests.mariadb_server import ThrowawayMariaDB  # noqa: PLC0415

        self.server = ThrowawayMariaDB().start()
        self._background = ThreadPoolExecutor(1, thread_name_prefix="test-mariadb")
        self._next: Future[str] | None = None

    def _migrated(self) -> str:
        name = "t_" + uuid.uuid4().hex[:12]
        self.server.create_database(name)
        engine = create_engine(self.server.url(name))
        upgrade(engine)
        engine.dispose()
        return name

    def new_database(self, *, migrated: bool) -> str:
        if not migrated:
            name = "t_" + uuid.uuid4().hex[:12]
            self.server.create_database(name)
            return name
        made = self._next.result() if self._next is not None else self._migrated()
        self._next = self._background.submit(self._migrated)
        return made

    def close(self) -> None:
        self._background.shutdown(wait=True)
        self.server.stop()


LONG_TESTS = (
    # Each at least 20 s alone (``--durations``), in ``LONG_TESTS`` so that every pytest
    # worker starts its share of them first (``_long_first``): one left for the end of a
    # worker's queue ran alone while the other workers had finished.
    "sources/test_rq_supervised.py::", "statemachine/test_store_machine.py::",
    "chaos/test_chaos_short.py::", "chaos/test_foreign_chaos_short.py::",
    "unit/test_plan_batch.py::test_a_batch_plans_as_each_row_alone",
    "sources/test_celery_liveness.py::test_redis_stopped_and_started_under_a_running_sidecar",
    "sources/test_celery_liveness.py::TestDoubtedBroker::test_no_worker_answering_at_all",
    "integration/test_replicas.py::test_four_reconciler_run_replicas",
    "sources/test_one_pass_cli.py::test_a_django_project",
)


def cache_bytecode() -> None:
    """Let Python cache compiled bytecode for this process and every process it starts,
    where the environment turned that off (``PYTHONDONTWRITEBYTECODE``, set on some CI
    images and development machines): the suite starts about a thousand interpreters, and
    without the cache each compiles this project's modules again and each pytest worker
    rewrites every test module's asserts again (collection alone: 8.1 CPU-s against 2.8).
    The files go where Python puts them, in ``__pycache__`` folders git ignores."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


def pytest_configure(config: pytest.Config) -> None:
    """Before any test runs, once (not in each xdist worker): the Debian packages the suite
    drives (tests/system_packages.py), installed where missing when running as root, else
    named in one line (under ``CI=true`` the run stops there: a missing package is never a
    silent skip); with xdist, every test module's asserts rewritten once for the workers
    (tests/rewrite_cache.py)."""
    cache_bytecode()
    if hasattr(config, "workerinput"):
        return
    if getattr(config.option, "numprocesses", None):
        rewrite_cache.warm(config)
    missing = system_packages.ensure(system_packages.SUITE)
    if not missing:
        return
    line = (f"tests: missing Debian packages ({', '.join(missing)}); their tests are "
            f"skipped; install them with: {system_packages.install_line(missing)}")
    if os.environ.get("CI", "").lower() == "true":
        pytest.exit(f"CI=true but {line}", returncode=pytest.ExitCode.USAGE_ERROR)
    print(line, file=sys.stderr)


def _engines_of(item: pytest.Item) -> set[str]:
    """The engines a test's parameters name (a plain engine name, or one inside a tuple:
    the conformance suite's ``(source, engine)``)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return set()
    names: set[str] = set()
    for value in callspec.params.values():
        for part in value if isinstance(value, tuple) else (value,):
            if isinstance(part, str) and part in ("sqlite", "postgresql", "mariadb"):
                names.add(part)
    return names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``EVERY_ENGINE_MODULES``, and ``fast`` the edit-run loop's lane (the unit tests,
    the pure core and the import contract among them, and the conformance suite on
    SQLite); unless the engines were chosen, leave out the MariaDB runs of the tests not
    marked ``every_engine`` (module docstring)."""
    tests_root = Path(__file__).resolve().parent
    kept, left_out = [], []
    for item in items:
        relative = (item.path.relative_to(tests_root).as_posix()
                    if item.path.is_relative_to(tests_root) else "")
        every_engine = relative in EVERY_ENGINE_MODULES
        if every_engine:
            item.add_marker(pytest.mark.every_engine)
        engines = _engines_of(item)
        if relative.startswith("unit/") or (relative.startswith("conformance/")
                                            and engines <= {"sqlite"}):
            item.add_marker(pytest.mark.fast)
        on_mariadb = "mariadb" in engines
        (left_out if on_mariadb and not every_engine and not ENGINES_CHOSEN
         else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    items[:] = _long_first(items, workers, tests_root)


def _long_first(items: list[pytest.Item], workers: int, tests_root: Path) -> list[pytest.Item]:
    """The collection reordered for ``--dist worksteal``, which hands each of ``workers``
    an equal run of the list and lets an idle worker take the far end of another's: each
    run begins with its share of ``LONG_TESTS``, so none of them starts last. Every
    worker computes the same order (xdist requires it)."""
    if workers < 2:
        return items

    def is_long(item: pytest.Item) -> bool:
        node = item.nodeid.removeprefix(f"{tests_root.name}/")
        return node.startswith(LONG_TESTS)

    long = [item for item in items if is_long(item)]
    rest = [item for item in items if not is_long(item)]
    ordered: list[pytest.Item] = []
    for worker in range(workers):
        ordered += long[worker::workers]
        ordered += rest[len(rest) * worker // workers:len(rest) * (worker + 1) // workers]
    return ordered


@pytest.fixture(scope="session")
def mariadb() -> Iterator[MariaDBForTests]:
    """The session's MariaDB, started by the first test that needs it."""
    require_mariadb_bin()
    shared = MariaDBForTests()
    yield shared
    shared.close()


def database_url(request: pytest.FixtureRequest, tmp_path: Path,
                 postgres: PostgresForTests | None, *, migrated: bool) -> Iterator[str]:
    """A fresh database on the engine ``request.param`` (for a fixture of a test's own)."""
    if request.param == "mariadb":
        db: MariaDBForTests = request.getfixturevalue("mariadb")
        name = db.new_database(migrated=migrated)
        yield db.server.url(name)
        db.server.drop_database(name)
        return
    if request.param == "sqlite":
        yield fresh_database(tmp_path) if migrated else f"sqlite:///{tmp_path / 'jobs.db'}"
        return
    if postgres is None:
        pytest.skip(f"PostgreSQL not available: {INSTALL_HINT}")
    name = postgres.new_database(migrated=migrated)
    yield postgres.url(name)
    postgres.drop(name)


@pytest.fixture(params=ENGINES)
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path,
                 postgres: PostgresForTests | None) -> Iterator[str]:
    """A URL of an empty database (no schema) on each engine."""
    yield from database_url(request, tmp_path, postgres, migrated=False)


@pytest.fixture(params=ENGINES)
def db_url(request: pytest.FixtureRequest, tmp_path: Path,
           postgres: PostgresForTests | None) -> Iterator[str]:
    """A URL of a freshly migrated database on each engine."""
    yield from database_url(request, tmp_path, postgres, migrated=True)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """An engine on the migrated database."""
    eng = create_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture
def store(engine: Engine) -> SqlStore:
    """The store on the migrated database."""
    return SqlStore(engine)


@pytest.fixture
def settings(db_url: str) -> Settings:
    """Settings pointing at the migrated database, with fast retries for tests."""
    return Settings(database_url=db_url, retry_backoff_seconds=0.2,
                    retry_backoff_max_seconds=1.0)


@pytest.fixture
def client(engine: Engine, settings: Settings) -> Iterator[JobClient]:
    """A JobClient on the migrated database."""
    with JobClient(engine, settings=settings) as c:
        yield c


def run_python(body: str, *args: str, timeout: float = 60,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a Python snippet in a fresh interpreter (a real, separate process): for a test
    of what an interpreter starts with (the modules it imports, its time zone)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body), *args], check=False, capture_output=True,
        text=True,
        timeout=timeout, cwd=REPO_ROOT, env={**os.environ, **(env or {})},
    )


def run_forked(body: str, *args: str, timeout: float = 60,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a Python snippet as ``run_python`` does, in a process forked by the suite's fork
    server (tests/fork_server.py): a real, separate process without an interpreter's 0.6
    CPU-s of imports, for the many workers and racers the tests start."""
    return run_script(textwrap.dedent(body), *args, timeout=timeout, cwd=str(REPO_ROOT),
                      env={**os.environ, **(env or {})})


def run_cli(db: str, *args: str, timeout: float = 60, process: bool | None = None,
            **settings: Any) -> subprocess.CompletedProcess[str]:
    """``reconciler ARGS`` against ``db`` with settings as env vars, as a finished process.

    In this process (tests/cli_runner.py) but for ``run`` and ``demo`` (``process``: see
    ``run_main``); a test about the process itself (signals, pipes, the installed script)
    starts one on its own."""
    return run_main(args, env=settings_env(db, **settings), timeout=timeout, process=process)
