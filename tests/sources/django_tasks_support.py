"""A real Django project (tests/sources/django_app) beside the reconciler, on both engines.

Django's own ``migrate`` creates the backend's table: once per session into a SQLite file
that already holds the reconciler's tables (each test gets a copy), and once into the
session's PostgreSQL database (each test empties the table). ``DjangoTasksFactory`` puts
task results in the states a source must judge, written as the backend writes them
(``enqueue``'s row, then ``claim``'s status, ``started_at`` and ``worker_ids``), with the
claim's clock moved back the way time would.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Connection, Engine

from models import StepLedgerEntry
from reconciler.core.kinds import KindRules
from reconciler.core.ports import JobKey
from reconciler.ledger import Step, StepLedger
from reconciler.sources.django_tasks import (
    DECLARATION,
    EXCEPTION_CLASS_PATH,
    DjangoTasksConfig,
)
from reconciler.sources.kit.source import DeclaredSource
from reconciler.storage.clock import now_plus
from reconciler.storage.engines import create_engine
from tests.conftest import ENGINES, REPO_ROOT
from tests.helpers import fresh_database
from tests.sources.conftest import (
    SourcesDatabase,
    empty_for_a_test,
    sqlite_copy,
    unavailable,
)
from tests.sources.support import run_command

TABLE = "django_tasks_database_dbtaskresult"
LONG_AGO_SECONDS = 6 * 3600  # beyond every lease these tests use, as in factories.py
StepSpec = tuple[str, str, str | None]
"""(step name, effect kind, state: "succeeded" | "started" | "failed" | None), as in
factories.py (not imported: tests/sources/conftest.py imports this module, and factories.py
imports that)."""
DATE_MAX = "9999-01-01 00:00:00"
LEDGER = cast(sa.Table, StepLedgerEntry.__table__)
STATUSES = {"READY": "queued", "RUNNING": "running", "FAILED": "failed",
            "SUCCESSFUL": "completed"}


def require_django() -> None:
    """Skip (or fail under CI=true) without Django and the tasks backport."""
    try:
        import django_tasks  # noqa: F401, PLC0415 - only a presence check
        import django_tasks_db  # noqa: F401, PLC0415
    except ImportError:
        unavailable("django, django-tasks and django-tasks-db are not installed: "
                    "pip install -e '.[test]'")


@dataclass(frozen=True)
class DjangoDatabase:
    """One database holding the reconciler's tables and the Django project's."""

    url: str
    """The SQLAlchemy URL (the reconciler's database_url)."""
    django_url: str
    """The same database as the test project's settings read it (``SOURCES_DJANGO_DB``)."""
    engine: Engine
    python: str = sys.executable
    """The interpreter of the project's processes: the suite's, or a venv's with Django 6."""

    @property
    def engine_name(self) -> str:
        return self.engine.dialect.name

    def env(self, markers: Path) -> dict[str, str]:
        """The environment of the project's processes (worker, enqueue, result)."""
        return {"SOURCES_DJANGO_DB": self.django_url, "SOURCES_MARKERS": str(markers),
                "SOURCES_DATABASE_URL": self.url,
                "DJANGO_SETTINGS_MODULE": "tests.sources.django_app.settings"}

    def manage(self, *args: str, markers: Path | None = None) -> str:
        """Run one command of the test project to its end; its output."""
        env = {**os.environ, **self.env(markers or Path("/nonexistent"))}
        done = run_command([self.python, "-m", "tests.sources.django_app.manage", *args],
                           env, REPO_ROOT, timeout=120)
        if done.returncode != 0:
            pytest.fail(f"django {' '.join(args)} failed: {done.stderr.strip()[-800:]}",
                        pytrace=False)
        return done.stdout


def worker_argv(python: str = sys.executable) -> list[str]:
    """The backend's own worker, polling every 0.1 s, every queue."""
    return [python, "-m", "tests.sources.django_app.manage", "db_worker",
            "--queue-name", "*", "--interval", "0.1", "--no-startup-delay", "--no-reload"]


@pytest.fixture(scope="session")
def django_sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file with the reconciler's tables and Django's migrate applied, once."""
    require_django()
    folder = tmp_path_factory.mktemp("django-template")
    url = fresh_database(folder)
    path = Path(url.removeprefix("sqlite:///"))
    engine = create_engine(url)
    DjangoDatabase(url, url, engine).manage("migrate", "-v0")
    engine.dispose()
    return path


@pytest.fixture(scope="session")
def django_tasks_schema(sources_db: SourcesDatabase) -> str:
    """Django's migrate, applied once into the session's PostgreSQL database."""
    require_django()
    DjangoDatabase(sources_db.url, sources_db.libpq, sources_db.engine).manage("migrate", "-v0")
    return TABLE


@pytest.fixture(scope="session")
def django_tasks_mariadb_schema(mariadb_sources_db: SourcesDatabase) -> str:
    """Django's migrate, applied once into the session's MariaDB database."""
    require_django()
    DjangoDatabase(mariadb_sources_db.url, mariadb_sources_db.url,
                   mariadb_sources_db.engine).manage("migrate", "-v0")
    return TABLE


@pytest.fixture(params=ENGINES)
def django_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DjangoDatabase]:
    """The Django project's database on each engine, its task table empty."""
    yield from open_django_db(request, request.param, tmp_path)


def open_django_db(request: pytest.FixtureRequest, engine_name: str, folder: Path
                   ) -> Iterator[DjangoDatabase]:
    """A copy of the SQLite template, or the session's PostgreSQL (or MariaDB) database
    emptied."""
    if engine_name == "mariadb":
        maria: SourcesDatabase = request.getfixturevalue("mariadb_sources_db")
        request.getfixturevalue("django_tasks_mariadb_schema")
        empty_for_a_test(maria, TABLE)
        yield DjangoDatabase(maria.url, maria.url, maria.engine)
        return
    if engine_name == "sqlite":
        template: Path = request.getfixturevalue("django_sqlite_template")
        with sqlite_copy(template, folder) as (url, engine):
            yield DjangoDatabase(url, url, engine)
        return
    db: SourcesDatabase = request.getfixturevalue("sources_db")
    request.getfixturevalue("django_tasks_schema")
    empty_for_a_test(db, TABLE)
    yield DjangoDatabase(db.url, db.libpq, db.engine)


def record_steps(engine: Engine, source_name: str, job: JobKey, attempt: int,
                 steps: Sequence[StepSpec], *, age: float = LONG_AGO_SECONDS) -> None:
    """Record step states through the real step ledger, as the task would have, ``age``
    seconds ago (the ledger's clock moved back on either engine)."""
    with StepLedger(engine) as ledger:
        run = ledger.run(source_name, job, attempt, [Step(n, e) for n, e, _ in steps])
        for index, (_, _, state) in enumerate(steps):
            if state is None:
                continue
            block = run.step(index)
            block.__enter__()
            if state == "succeeded":
                block.__exit__(None, None, None)
            elif state == "failed":
                error = RuntimeError("step failed")
                block.__exit__(RuntimeError, error, None)
    set_ledger(engine, source_name, job, updated_at=now_plus(-age))


def set_ledger(engine: Engine, source_name: str, job: JobKey, step: int | None = None,
               **values: Any) -> None:
    """Direct writes to the job's ledger rows: what the ledger API never writes."""
    where = [LEDGER.c.source_name == source_name, LEDGER.c.job_key == str(job)]
    if step is not None:
        where.append(LEDGER.c.step_index == step)
    with engine.begin() as conn:
        conn.execute(LEDGER.update().where(*where).values(**values))


class DjangoTasksFactory:
    """Task results of django-tasks-db, written as its backend writes them."""

    source_name = "django-tasks"
    default_max_attempts = 3

    def __init__(self, db: DjangoDatabase, config: DjangoTasksConfig | None = None) -> None:
        self.db = db
        self.engine = db.engine
        self.config = config or DjangoTasksConfig()
        self.table = sa.table(TABLE, sa.column("id", sa.Uuid()), *(sa.column(c) for c in (
            "status", "args_kwargs", "priority", "task_path", "queue_name", "backend_name",
            "run_after", "enqueued_at", "started_at", "finished_at", "return_value",
            "exception_class_path", "traceback", "worker_ids")))

    def open_source(self, conn: Connection, kinds: KindRules, *,
                    lock: bool = True) -> DeclaredSource:
        return DECLARATION.open(conn, self.config, kinds, lock=lock)

    def _json(self, value: Any) -> Any:
        text = json.dumps(value)
        if self.engine.dialect.name == "postgresql":
            return sa.cast(sa.literal(text), JSONB)
        return text

    def _update(self, job: JobKey, **values: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(self.table.update().where(self.table.c.id == uuid.UUID(str(job)))
                         .values(**values))

    def enqueue(self, kind: str, kwargs: dict[str, Any] | None = None, *,
                backend: str = "default") -> str:
        """A ``READY`` row as the backend's ``enqueue`` inserts it."""
        job = uuid.uuid4()
        run_after = DATE_MAX + "+00" if self.engine.dialect.name == "postgresql" else DATE_MAX
        with self.engine.begin() as conn:
            conn.execute(self.table.insert().values(
                id=job, status="READY", priority=0, task_path=kind, queue_name="default",
                backend_name=backend, run_after=run_after, enqueued_at=now_plus(0),
                args_kwargs=self._json({"args": [], "kwargs": kwargs or {}}),
                exception_class_path="", traceback="", worker_ids=self._json([])))
        return str(job)

    def claim(self, job: JobKey, *, age: float, worker: str | None = None) -> str:
        """``claim`` as the backend's worker does it, ``age`` seconds ago."""
        worker = worker or f"worker-{uuid.uuid4().hex[:8]}"
        row = self.row(job)
        assert row is not None
        self._update(job, status="RUNNING", started_at=now_plus(-age),
                     worker_ids=self._json([*row["worker_ids"], worker]))
        return worker

    def died(self, kind: str, *, attempts_used: int = 1,
             steps: Sequence[StepSpec] | None = None) -> str:
        job = self.enqueue(kind)
        for _ in range(attempts_used - 1):
            self.claim(job, age=LONG_AGO_SECONDS)
        self.claim(job, age=LONG_AGO_SECONDS)
        if steps:
            record_steps(self.engine, self.source_name, job, attempts_used, steps)
        return job

    def live(self, kind: str) -> str:
        job = self.enqueue(kind)
        self.claim(job, age=0)
        return job

    def exhausted(self, kind: str) -> str:
        return self.died(kind, attempts_used=self.default_max_attempts)

    def queued(self, kind: str) -> str:
        return self.enqueue(kind)

    def complete(self, job: JobKey) -> None:
        """``set_successful``, as a (late) worker writes it: by id only."""
        self._update(job, status="SUCCESSFUL", finished_at=now_plus(0),
                     return_value=self._json("late"), exception_class_path="", traceback="")

    def row(self, job: JobKey) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            found = conn.execute(sa.select(self.table).where(
                self.table.c.id == uuid.UUID(str(job)))).mappings().first()
        if found is None:
            return None
        row = dict(found)
        if self.engine.dialect.name != "postgresql":  # JSON text there; jsonb arrives decoded
            for key in ("worker_ids", "args_kwargs", "return_value"):
                if row[key] is not None:
                    row[key] = json.loads(row[key])
        return row

    def status(self, job: JobKey) -> str:
        row = self.row(job)
        return "absent" if row is None else STATUSES.get(row["status"], row["status"])

    def attempts_used(self, job: JobKey) -> int:
        row = self.row(job)
        assert row is not None
        return len(row["worker_ids"])

    def error_text(self, job: JobKey) -> str | None:
        """Our reason code: the last line of a traceback the reconciler wrote."""
        row = self.row(job)
        if row is None or row["exception_class_path"] != EXCEPTION_CLASS_PATH:
            return None
        last = str(row["traceback"]).strip().splitlines()[-1]
        return last.split(": ", 1)[1] if ": " in last else None
