"""InnoDB deadlocks inside a worker's write or a pass: retried inside the operation, never
the worker's failure or the pass's error (MySQL and MariaDB only; the other engines' writes
lock in one order and never deadlock).

Each test makes a real deadlock: another transaction, heavier (it inserted rows, so InnoDB
rolls the lighter one back), holds the job's attempt row, waits until the operation holds
the job's row and waits for the attempt, then asks for the job's row.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from models import JobAttempt, JobRun, ReconciliationPass
from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, run_pass
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient, Step
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

jobs = cast(sa.Table, JobRun.__table__)
attempts = cast(sa.Table, JobAttempt.__table__)
passes = cast(sa.Table, ReconciliationPass.__table__)
STEPS = [Step("only", "idempotent")]


@pytest.fixture(autouse=True)
def _mysql_only(engine: Engine) -> None:
    if engine.dialect.name != "mysql":
        pytest.skip("deadlocks are InnoDB's: MySQL and MariaDB")


def deadlocks(engine: Engine) -> int:
    """The server's count of deadlocks detected so far."""
    with engine.connect() as conn:
        return int(conn.exec_driver_sql(
            "SHOW GLOBAL STATUS WHERE Variable_name = 'Innodb_deadlocks'").one()[1])


def waiting_on_attempts(engine: Engine) -> bool:
    """True while some session runs (here: waits in) an UPDATE of ``job_attempts``."""
    with engine.connect() as conn:
        return bool(conn.execute(sa.text(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE :update"),
            {"update": "UPDATE job_attempts%"}).scalar())


@contextmanager
def heavier_holder_of_the_attempt(engine: Engine, job_id: int) -> Iterator[Connection]:
    """A transaction holding the job's attempt row, heavier than any store operation (it
    inserted 200 jobs, which it rolls back at the end)."""
    now = datetime.now(UTC)
    with engine.connect() as conn, conn.begin() as tx:
        conn.execute(jobs.insert(), [
            {"job_kind": "ballast", "job_status": "queued", "max_attempts": 1,
             "available_at": now, "created_at": now, "updated_at": now}
            for _ in range(200)])
        conn.execute(sa.select(attempts.c.job_id).where(attempts.c.job_id == job_id)
                     .with_for_update()).all()
        yield conn
        tx.rollback()


def in_thread(operation: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``operation`` started in a thread; its result (or its error) lands in the list."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(operation())
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_a_deadlocked_completion_is_retried_and_completes(
        client: JobClient, engine: Engine) -> None:
    """A worker's complete() chosen as a deadlock's victim runs again and completes: the
    worker never sees the deadlock."""
    job_id = client.enqueue("report", steps=STEPS)
    claim = client.claim(worker="w", lease_seconds=30)
    assert claim is not None
    before = deadlocks(engine)
    with heavier_holder_of_the_attempt(engine, job_id) as holder:
        thread, outcome = in_thread(claim.complete)
        wait_for(lambda: waiting_on_attempts(engine), "complete() to wait for the attempt")
        # The cycle: the holder asks for the job's row, which complete() holds.
        holder.execute(sa.select(jobs.c.job_id).where(jobs.c.job_id == job_id)
                       .with_for_update()).all()
        time.sleep(0.2)  # complete() runs again meanwhile, and waits for the holder
    thread.join(timeout=30)

    assert len(outcome) == 1, "the operation did not return"
    assert not isinstance(outcome[0], Exception), outcome
    assert deadlocks(engine) > before
    with engine.connect() as conn:
        assert conn.execute(sa.select(jobs.c.job_status).where(jobs.c.job_id == job_id)
                            ).scalar_one() == "completed"
        assert conn.execute(sa.select(attempts.c.attempt_outcome)
                            .where(attempts.c.job_id == job_id)).scalar_one() == "completed"


def test_a_deadlocked_pass_runs_again_and_is_no_error(
        client: JobClient, engine: Engine, store: SqlStore) -> None:
    """A pass chosen as a deadlock's victim runs again: its report and its record are an
    ordinary pass, never an error; the job it could not have is the next pass's."""
    job_id = client.enqueue("report", steps=STEPS)
    assert client.claim(worker="gone", lease_seconds=0.2) is not None
    time.sleep(0.5)
    config = PassConfig(batch_size=10, thresholds=Thresholds(0.0, 3600.0), instance="r1")
    before = deadlocks(engine)
    with heavier_holder_of_the_attempt(engine, job_id) as holder:
        thread, outcome = in_thread(lambda: run_pass(store, config))
        wait_for(lambda: waiting_on_attempts(engine), "the pass to wait for the attempt")
        holder.execute(sa.select(jobs.c.job_id).where(jobs.c.job_id == job_id)
                       .with_for_update()).all()
        thread.join(timeout=30)  # run again, it skips the row the holder now has
    assert len(outcome) == 1, "the operation did not return"
    assert not isinstance(outcome[0], Exception), outcome
    assert outcome[0].outcome.value == "ok"
    assert deadlocks(engine) > before
    with engine.connect() as conn:
        assert set(conn.execute(sa.select(passes.c.pass_outcome)).scalars()) == {"ok"}

    after = run_pass(store, config)
    assert [(d.job_id, d.disposition.value) for d in after.decisions] == [(job_id, "resume")]
