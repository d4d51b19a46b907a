"""The ``celery`` source's fixtures: Celery's own result table (created by its own models),
and django-celery-results' (made by its own migrations), each with a real Redis broker, on
SQLite and PostgreSQL.

Result rows are written as a Celery worker writes them with ``task_track_started`` and
``result_extended`` (``STARTED``, name, args, kwargs, worker, retries, queue, and its
``{"pid", "hostname"}`` result; django-celery-results: no retries or queue, the arguments
as their repr, every date stamped), steps through the real step ledger. The attempt of a
django-celery-results task is the ledger's (the table keeps no retry count). A live owner is a real
Celery worker of the session (``live@conformance``) holding the task's request in its
process; a dead one is a hostname nobody answers for, and the reconciler's memory in the
broker of when it first found the task held by no worker is moved back to
``TIMING.lease_expired_seconds`` past the session timeout, the way passes over time would
have recorded it.

Declared gaps, beside those every ledger-backed system shares: recent activity does not
protect a task whose worker is gone (as for Procrastinate: the owner's death is the lease).
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.core.ports import JobKey
from reconciler.sources.celery import CeleryConfig
from reconciler.sources.celery.broker import FIRST_SEEN_KEY, CeleryBroker
from reconciler.sources.celery.holders import UNHELD_KEY
from reconciler.storage.clock import now_plus
from reconciler.storage.engines import create_engine
from tests.conformance.fixtures import (
    TIMING,
    Capability,
    Interference,
    Outcome,
    RegisteredSource,
    Situation,
    SourceJob,
    State,
)
from tests.conformance.foreign import ForeignFixture, clear_audit, kind_for
from tests.conformance.systems import _common_gaps, _every, _specs
from tests.helpers import fresh_database, rows_of
from tests.sources.celery_support import (
    DJANGO_TABLE,
    _celery_tables,
    declare_queues,
    hold_task,
    open_django_celery,
    shared_database,
)
from tests.sources.conftest import clear_ledger
from tests.sources.django_tasks_support import LEDGER, record_steps, set_ledger

OUTCOMES: dict[str, Outcome] = {"STARTED": "running", "RETRY": "runnable",
                                "FAILURE": "failed", "SUCCESS": "completed"}
ROWS = sa.table("celery_taskmeta", *(sa.column(c) for c in (
    "task_id", "status", "result", "date_done", "traceback", "name", "args", "kwargs",
    "worker", "retries", "queue")))
DJANGO_ROWS = sa.table(DJANGO_TABLE, *(sa.column(c) for c in (
    "task_id", "status", "result", "date_done", "traceback", "task_name", "task_args",
    "task_kwargs", "worker", "content_type", "content_encoding", "date_created",
    "date_started", "meta", "periodic_task_name")))


class CeleryFixture(ForeignFixture):
    """Celery's result rows and broker as a source under test (see ``SourceFixture``)."""

    source_name = "celery"
    gaps: dict[Capability, str] = _common_gaps("celery") | {
        **_every(State.RECENTLY_ACTIVE, "celery's lease is its worker's answer to ping: a "
                 "worker gone is the lease run out, and then recent activity protects "
                 "nothing"),
    }

    def __init__(self, engine: Engine, broker_url: str, live_worker: str,
                 table: str = "celery_taskmeta") -> None:
        super().__init__(engine, CeleryConfig(
            broker_url=broker_url, result_table=table,
            session_timeout_seconds=TIMING.session_timeout_seconds))
        self.django = table == DJANGO_TABLE
        self.rows = DJANGO_ROWS if self.django else ROWS
        self.broker = CeleryBroker(broker_url)
        self.live_worker = live_worker
        self._serial = itertools.count(1)

    def key_of(self, text: str) -> JobKey:
        return text

    # -- making situations --------------------------------------------------------------------

    def _started(self, kind: str, worker: str, retries: int = 0) -> str:
        """A STARTED row as the worker's ``on_accepted`` store writes it."""
        task_id = str(uuid.uuid4())
        if self.django:
            # As django-celery-results stores it: JSON of the message's argsrepr, dates
            # from Django's clock (auto_now_add, auto_now) and the database's (Now()).
            with self.engine.begin() as conn:
                conn.execute(DJANGO_ROWS.insert().values(
                    task_id=task_id, status="STARTED", task_name=kind,
                    task_args=json.dumps("()"), task_kwargs=json.dumps("{}"), worker=worker,
                    content_type="application/json", content_encoding="utf-8",
                    result=json.dumps({"pid": 1, "hostname": worker}),
                    meta=json.dumps({"children": []}), date_created=now_plus(0),
                    date_started=now_plus(0), date_done=now_plus(0)))
            return task_id
        from celery.backends.database.models import TaskExtended  # noqa: PLC0415

        # Celery's own table object: its id comes from Celery's sequence on PostgreSQL.
        with self.engine.begin() as conn:
            conn.execute(TaskExtended.__table__.insert().values(
                task_id=task_id, status="STARTED", name=kind, args=b"[]", kwargs=b"{}",
                worker=worker, retries=retries, queue="celery", date_done=None,
                result=json.dumps({"pid": 1, "hostname": worker}).encode()))
        return task_id

    def _dead_worker(self, task_id: str) -> None:
        """The reconciler's memory: held by no worker long since, first seen long since."""
        client = self.broker._client()
        long_ago = self.broker.now() - (TIMING.lease_seconds + TIMING.lease_expired_seconds)
        client.hset(UNHELD_KEY, task_id, repr(long_ago))
        client.hset(FIRST_SEEN_KEY, task_id, repr(long_ago))

    def make(self, situation: Situation) -> SourceJob:
        """A task started by a live or a dead worker, its steps recorded in the ledger."""
        state, n = situation.state, situation.step
        kind = kind_for(situation.effect, next(self._serial))
        specs = _specs(situation)
        if state in (State.LIVE, State.WEDGED, State.OWNER_REBORN_HOLDING):
            task_id = self._started(kind, self.live_worker)
            if state is State.OWNER_REBORN_HOLDING:
                # Held by no worker once (its first run's worker died), then taken again
                # by the process now under that name: the memory is stale, the task held.
                self._dead_worker(task_id)
            hold_task(self.broker.broker_url, task_id)
            if state is State.WEDGED:
                record_steps(self.engine, self.source_name, task_id, 1, specs,
                             age=TIMING.wedged_after_seconds + 60)
            return SourceJob(task_id, 1)
        retries = 2 if state is State.OUT_OF_ATTEMPTS else 0
        # A reborn owner: the name answers (a live worker has it now) but holds nothing.
        worker = (self.live_worker if state is State.OWNER_REBORN
                  else f"dead-{uuid.uuid4().hex[:8]}@conformance")
        task_id = self._started(kind, worker, retries)
        self._dead_worker(task_id)
        record_steps(self.engine, self.source_name, task_id, retries + 1, specs)
        if state is State.STEP_FAILED:
            set_ledger(self.engine, self.source_name, task_id, step=n, failure_retryable=False)
        return SourceJob(task_id, retries + 1)

    def interfere(self, job: SourceJob, change: Interference) -> None:
        """The slow worker's late write, or another replica and worker taking the task."""
        key = str(job.key)
        if change is Interference.LATE_PROGRESS:
            set_ledger(self.engine, self.source_name, key, updated_at=now_plus(0))
        elif change is Interference.LATE_HEARTBEAT:
            # A worker held the task: the reconciler forgets when it found it unheld.
            self.broker._client().hdel(UNHELD_KEY, key)
        elif change is Interference.LATE_COMPLETION:
            self._update(key, status="SUCCESS", date_done=now_plus(0),
                         result=self._encoded(json.dumps("late")))
        elif change is Interference.RECLAIM:
            recovered = self.run_pass()
            assert [d.job_id for d in recovered.decisions] == [key]
            assert self.status(job) == "runnable"
            # A new worker takes the re-published task, then dies as well.
            worker = f"dead-{uuid.uuid4().hex[:8]}@conformance"
            values: dict[str, Any] = {"status": "STARTED", "worker": worker, "result":
                                      self._encoded(json.dumps({"pid": 2, "hostname": worker}))}
            if self.django:
                values |= {"date_done": now_plus(0), "date_started": now_plus(0)}
            else:
                values["retries"] = int(self._row(key)["retries"]) + 1
            self._update(key, **values)
            self._dead_worker(key)
        else:  # pragma: no cover - every member is handled above
            raise AssertionError(change)

    def _encoded(self, text: str) -> str | bytes:
        """A result as the table stores it: text (django-celery-results) or bytes."""
        return text if self.django else text.encode()

    def _update(self, key: str, **values: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(self.rows.update().where(self.rows.c.task_id == key).values(**values))

    # -- observing ----------------------------------------------------------------------------

    def _row(self, key: str) -> dict[str, Any]:
        [row] = rows_of(self.engine, self.rows, self.rows.c.task_id == key)
        return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in row.items()}

    def status(self, job: SourceJob) -> Outcome:
        return OUTCOMES[self._row(str(job.key))["status"]]

    def reason(self, job: SourceJob) -> str | None:
        """Our reason code, from the exception the reconciler stored."""
        raw = self._row(str(job.key))["result"]
        try:
            message = json.loads(raw)["exc_message"][0]
        except (TypeError, ValueError, KeyError, IndexError):
            return None
        return str(message).split(" ", 1)[0]

    def resume_step(self, job: SourceJob) -> int | None:
        return None

    def generation(self, job: SourceJob) -> int | None:
        return None

    def snapshot(self, job: SourceJob) -> object:
        """The task's row and its ledger rows."""
        return (self._row(str(job.key)), rows_of(
            self.engine, LEDGER, LEDGER.c.source_name == self.source_name,
            LEDGER.c.job_key == str(job.key), order=LEDGER.c.step_index))


def still_answering(broker_url: str, live: str) -> None:
    """Wait for the session's live worker to answer ping: on a loaded machine one ping of a
    second can go unanswered by a worker that is there."""
    broker = CeleryBroker(broker_url)
    deadline = time.monotonic() + 30
    while broker.answers([live], ()).answering != {live}:
        assert time.monotonic() < deadline, f"{live} stopped answering ping"


@contextmanager
def open_celery(request: pytest.FixtureRequest) -> Iterator[CeleryFixture]:
    """On the test's engine: a fresh SQLite file, or the session's PostgreSQL database with
    Celery's table emptied; the session's Redis emptied and its live worker answering."""
    live = request.getfixturevalue("celery_live_worker")
    broker_url = request.getfixturevalue("redis_url")
    # Emptied for the test: the live worker still answers (ping is a broadcast, not a key).
    still_answering(broker_url, live)
    declare_queues(broker_url, "celery")  # the app's queue, as its workers declare it
    if request.param[1] == "sqlite":
        engine = create_engine(fresh_database(request.getfixturevalue("tmp_path")))
        _celery_tables(engine)
        try:
            yield CeleryFixture(engine, broker_url, live)
        finally:
            engine.dispose()
        return
    db = shared_database(request, request.param[1])
    _celery_tables(db.engine)
    db.execute("TRUNCATE celery_taskmeta")
    clear_ledger(db)
    clear_audit(db.engine)
    yield CeleryFixture(db.engine, broker_url, live)


CELERY = RegisteredSource("celery", ("sqlite", "postgresql", "mysql"), open_celery, shared=True)


@contextmanager
def open_django_celery_fixture(request: pytest.FixtureRequest) -> Iterator[CeleryFixture]:
    """django-celery-results' table on the test's engine (a migrated SQLite copy, or the
    session's PostgreSQL database emptied), the session's Redis emptied, its live worker."""
    live = request.getfixturevalue("celery_live_worker")
    broker_url = request.getfixturevalue("redis_url")
    still_answering(broker_url, live)
    declare_queues(broker_url, "celery")
    engine_name = request.param[1]
    projects = open_django_celery(request, engine_name, request.getfixturevalue("tmp_path"),
                                  broker_url)
    project = next(projects)
    try:
        yield CeleryFixture(project.engine, broker_url, live, DJANGO_TABLE)
    finally:
        projects.close()


CELERY_DJANGO = RegisteredSource("celery", ("sqlite", "postgresql", "mysql"),
                                 open_django_celery_fixture,
                                 shared=True, label="celery-django-celery-results")
"""The same source over django-celery-results' table."""
