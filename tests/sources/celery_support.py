"""A real Celery app (tests/sources/celery_app.py) over a real Redis, on both engines.

``redis_url``: Debian's ``redis-server`` started once per session on a free port (no
persistence), stopped at the end; emptied for each test (the rq tests use it too: it needs
the redis client alone). Without it, or without Celery for a Celery fixture, the tests are
skipped with the install line, or fail under CI=true; never a mock broker. ``celery_project``: the
reconciler's database on each engine with Celery's own result tables created by Celery's
own models (its database backend would create the same on first use);
``django_celery_project``: the same with django-celery-results' table instead, made by
its own migrations in the Django project tests/sources/celery_django.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tests.conftest import ENGINES
from tests.coverage_scope import unmeasured
from tests.helpers import fresh_database
from tests.sources.conftest import (
    SourcesDatabase,
    clear_ledger,
    empty_for_a_test,
    sqlite_copy,
    unavailable,
)
from tests.sources.support import Process, run_command

REDIS_HINT = "redis-server is needed for the Celery tests: apt-get install -y redis-server"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """A throwaway redis-server for the session; its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        unavailable(REDIS_HINT)
        return
    try:
        import redis  # noqa: PLC0415
    except ImportError:
        unavailable("redis (the client) is not installed: pip install -e '.[test]'")
        return
    folder = Path(tempfile.mkdtemp(prefix="reconciler-redis-"))
    port = _free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                pytest.fail("redis-server did not start", pytrace=False)
            time.sleep(0.05)
    try:
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        shutil.rmtree(folder, ignore_errors=True)


def require_celery() -> None:
    """Skip (or fail under CI=true) without Celery."""
    if importlib.util.find_spec("celery") is None:
        unavailable("celery[redis] is not installed: pip install -e '.[test]'")


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The session's Redis, emptied for this test."""
    import redis  # noqa: PLC0415 - present: redis_server checked

    redis.Redis.from_url(redis_server).flushall()
    return redis_server


DJANGO_TABLE = "django_celery_results_taskresult"
DJANGO_MANAGE = [sys.executable, "-m", "tests.sources.celery_django.manage"]


@dataclass(frozen=True)
class CeleryProject:
    """The test app's broker and result database (``django_url``: its results kept by
    django-celery-results, the database as Django's settings read it)."""

    broker_url: str
    database_url: str
    engine: Engine
    django_url: str | None = None

    @property
    def table(self) -> str:
        return "celery_taskmeta" if self.django_url is None else DJANGO_TABLE

    def env(self, markers: Path, *, acks_late: bool = False) -> dict[str, str]:
        django = {} if self.django_url is None else {
            "SOURCES_RESULTS": "django-db", "SOURCES_DJANGO_DB": self.django_url}
        return {"SOURCES_BROKER_URL": self.broker_url,
                "SOURCES_DATABASE_URL": self.database_url, "SOURCES_MARKERS": str(markers),
                "SOURCES_ACKS_LATE": "1" if acks_late else "0", **django}

    def result(self, task_id: str, timeout: float) -> dict[str, Any]:
        """What ``AsyncResult(task_id).get(timeout)`` gives the caller through
        django-celery-results, in a process of the Django project: ``value`` or ``raised``."""
        assert self.django_url is not None
        done = run_command([*DJANGO_MANAGE, "result", task_id, str(timeout)],
                           {**os.environ, **self.env(Path("/nonexistent"))},
                           Path(__file__).parents[2], timeout=timeout + 60)
        if done.returncode != 0:
            pytest.fail(f"result {task_id} failed: {done.stderr.strip()[-800:]}", pytrace=False)
        found: dict[str, Any] = json.loads(done.stdout)
        return found

    def migrate(self) -> None:
        """django-celery-results' own migrations, into the project's database."""
        done = run_command([*DJANGO_MANAGE, "migrate", "-v0"],
                           {**os.environ, **self.env(Path("/nonexistent"))},
                           Path(__file__).parents[2], timeout=120)
        if done.returncode != 0:
            pytest.fail(f"migrate failed: {done.stderr.strip()[-800:]}", pytrace=False)

    def caller(self) -> Any:
        """A Celery app as the caller's process has it: sends tasks, reads results (only
        sends, over django-celery-results: ``result`` reads them in a Django process)."""
        from celery import Celery  # noqa: PLC0415 - present: redis_server checked

        backend = f"db+{self.database_url}" if self.django_url is None else "disabled"
        app = Celery("caller", broker=self.broker_url, backend=backend, set_as_current=False)
        app.conf.update(result_extended=True, task_serializer="json",
                        result_serializer="json", accept_content=["json"])
        return app

    def restore_unacked(self, visibility_timeout: float) -> None:
        """kombu's own redelivery, now: what any worker's poll loop does every tenth poll
        (``QoS.restore_visible``: unacknowledged messages older than the timeout go back
        on their queues). Called by a test so it need not wait for a worker's turn."""
        app = self.caller()
        app.conf.broker_transport_options = {"visibility_timeout": visibility_timeout}
        with app.connection_for_write() as connection:
            connection.default_channel.qos.restore_visible(num=100)

    def status(self, task_id: str) -> str | None:
        """The result row's status (None: no row)."""
        row = self.row(task_id)
        return None if row is None else str(row["status"])

    def row(self, task_id: str) -> dict[str, Any] | None:
        columns = ("task_id, status, name, worker, retries, queue, date_done, result, traceback"
                   if self.django_url is None else "task_id, status, task_name, worker, "
                   "date_done, result, traceback")
        with self.engine.connect() as conn:
            found = conn.execute(sa.text(
                f"SELECT {columns} FROM {self.table} WHERE task_id = :id"),
                {"id": task_id}).mappings().first()
        return None if found is None else dict(found)


def declare_queues(broker_url: str, *queues: str) -> None:
    """Declare the app's queues on its broker, as its workers and callers do (kombu keeps
        their bindings in Redis, where the celery source looks for them): for a test that
    emptied Redis and has no worker of the app consuming them."""
    from kombu import Connection, Exchange, Queue  # noqa: PLC0415 - celery[redis] is there

    with Connection(broker_url) as connection:
        for name in queues:
            Queue(name, Exchange(name), routing_key=name)(connection.default_channel).declare()


def worker_argv(name: str, pool: str = "prefork", queues: str = "celery", *,
                concurrency: int = 1) -> list[str]:
    """One Celery worker, ``concurrency`` processes of work (one unless asked), its own
    hostname, these queues."""
    return [sys.executable, "-m", "celery", "-A", "tests.sources.celery_app", "worker",
            f"--pool={pool}", f"--concurrency={concurrency}", f"--hostname={name}@tests",
            "-Q", queues,
            "--without-mingle", "--without-gossip", "--loglevel=INFO"]


def worker_tree(worker: Process) -> list[int]:
    """The worker's pool processes, then the worker itself."""
    children = Path(f"/proc/{worker.pid}/task/{worker.pid}/children")
    return [*(int(c) for c in (children.read_text().split() if children.exists() else [])),
            worker.pid]


def kill_worker(worker: Process) -> None:
    """SIGKILL the whole worker, its pool processes first (a node lost, an OOM kill of the
    container): nothing of it is left to record an end."""
    for pid in worker_tree(worker)[:-1]:
        os.kill(pid, signal.SIGKILL)
    worker.kill()


def _celery_tables(engine: Engine) -> None:
    from celery.backends.database.models import TaskExtended  # noqa: PLC0415

    TaskExtended.metadata.create_all(engine)


def shared_database(request: pytest.FixtureRequest, engine_name: str) -> SourcesDatabase:
    """The session's database of a server engine: PostgreSQL's or MariaDB's."""
    fixture = "mariadb_sources_db" if engine_name == "mariadb" else "sources_db"
    db: SourcesDatabase = request.getfixturevalue(fixture)
    return db


@pytest.fixture(params=ENGINES)
def celery_project(request: pytest.FixtureRequest, tmp_path: Path, redis_url: str
                   ) -> Iterator[CeleryProject]:
    """Celery's result tables beside the reconciler's, on each engine, empty."""
    require_celery()
    if request.param == "sqlite":
        from reconciler.storage.engines import create_engine  # noqa: PLC0415

        url = fresh_database(tmp_path)
        engine = create_engine(url)
        _celery_tables(engine)
        try:
            yield CeleryProject(redis_url, url, engine)
        finally:
            engine.dispose()
        return
    db = shared_database(request, request.param)
    _celery_tables(db.engine)
    db.execute("TRUNCATE celery_taskmeta")
    clear_ledger(db)
    yield CeleryProject(redis_url, db.url, db.engine)


LIVE_WORKER = "live@conformance"
LIVE_QUEUE = "conformance-live"


def hold_task(broker_url: str, task_id: str) -> None:
    """The session's live worker made to hold ``task_id`` (a real request in its process,
    as a running task's is), without touching the result row a test wrote for it; it
    holds it until the test's Redis is emptied. Returns once the worker says it holds it."""
    import redis  # noqa: PLC0415 - present: redis_server checked
    from celery import Celery  # noqa: PLC0415

    from reconciler.sources.celery.broker import CeleryBroker  # noqa: PLC0415
    from tests.sources.celery_app import HOLD_PREFIX  # noqa: PLC0415

    redis.Redis.from_url(broker_url).set(HOLD_PREFIX + task_id, 1)
    sender = Celery("holder", broker=broker_url, set_as_current=False)
    sender.conf.update(task_serializer="json", broker_connection_retry_on_startup=True)
    sender.send_task("conformance.hold", task_id=task_id, queue=LIVE_QUEUE)
    sender.close()
    broker = CeleryBroker(broker_url)
    deadline = time.monotonic() + 30
    while task_id not in broker.answers((), (), {task_id: LIVE_WORKER}).held:
        assert time.monotonic() < deadline, f"{LIVE_WORKER} never held {task_id}"


@pytest.fixture(scope="session")
def celery_live_worker(redis_server: str, tmp_path_factory: pytest.TempPathFactory
                       ) -> Iterator[str]:
    """One real Celery worker for the session, answering as ``live@conformance`` and
    consuming only a queue of its own: it runs none of the tests' tasks, only what
    ``hold_task`` sends it (a thread pool, so it answers while it holds them)."""
    require_celery()
    folder = tmp_path_factory.mktemp("celery-live")
    argv = [sys.executable, "-m", "celery", "-A", "tests.sources.celery_app", "worker",
            "--pool=threads", "--concurrency=32", f"--hostname={LIVE_WORKER}",
            "--without-mingle", "--without-gossip", "-Q", LIVE_QUEUE, "--loglevel=WARNING"]
    log = (folder / "worker.log").open("ab")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                               env=unmeasured({**os.environ, "SOURCES_BROKER_URL": redis_server,
                                               "SOURCES_MARKERS": str(folder)}),
                               cwd=Path(__file__).parents[2])
    from reconciler.sources.celery.broker import CeleryBroker  # noqa: PLC0415

    broker = CeleryBroker(redis_server)
    deadline = time.monotonic() + 60
    while broker.answers([LIVE_WORKER], ()).answering != {LIVE_WORKER}:
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            pytest.fail("the live Celery worker never answered ping", pytrace=False)
    try:
        yield LIVE_WORKER
    finally:
        process.kill()
        process.wait(timeout=10)
        log.close()


@pytest.fixture(scope="session")
def django_celery_sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file with the reconciler's tables and django-celery-results' migrations,
    made once and copied for each test."""
    from reconciler.storage.engines import create_engine  # noqa: PLC0415

    url = fresh_database(tmp_path_factory.mktemp("django-celery-template"))
    engine = create_engine(url)
    CeleryProject("redis://unused", url, engine, url).migrate()
    engine.dispose()
    return Path(url.removeprefix("sqlite:///"))


@pytest.fixture(scope="session")
def django_celery_results_schema(sources_db: SourcesDatabase, redis_server: str) -> str:
    """django-celery-results' migrations, applied once into the session's PostgreSQL."""
    CeleryProject(redis_server, sources_db.url, sources_db.engine, sources_db.libpq).migrate()
    return DJANGO_TABLE


@pytest.fixture(scope="session")
def django_celery_results_mariadb_schema(mariadb_sources_db: SourcesDatabase,
                                         redis_server: str) -> str:
    """django-celery-results' migrations, applied once into the session's MariaDB."""
    CeleryProject(redis_server, mariadb_sources_db.url, mariadb_sources_db.engine,
                  mariadb_sources_db.url).migrate()
    return DJANGO_TABLE


@pytest.fixture(params=ENGINES)
def django_celery_project(request: pytest.FixtureRequest, tmp_path: Path, redis_url: str
                          ) -> Iterator[CeleryProject]:
    """django-celery-results' table beside the reconciler's, on each engine, empty."""
    yield from open_django_celery(request, request.param, tmp_path, redis_url)


def open_django_celery(request: pytest.FixtureRequest, engine_name: str, folder: Path,
                       redis_url: str) -> Iterator[CeleryProject]:
    """A fresh SQLite file migrated, or the session's PostgreSQL (or MariaDB) database
    emptied."""
    require_celery()
    if engine_name == "sqlite":
        template: Path = request.getfixturevalue("django_celery_sqlite_template")
        with sqlite_copy(template, folder) as (url, engine):
            yield CeleryProject(redis_url, url, engine, url)
        return
    db = shared_database(request, engine_name)
    request.getfixturevalue("django_celery_results_mariadb_schema" if engine_name == "mariadb"
                            else "django_celery_results_schema")
    # Attempts on this table are counted from the audit: each test starts with none.
    empty_for_a_test(db, DJANGO_TABLE)
    yield CeleryProject(redis_url, db.url, db.engine, db.libpq)
