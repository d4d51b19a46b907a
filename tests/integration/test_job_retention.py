"""Job retention: finished jobs older than job_retention_days go with their rows, in
bounded batches; live, recent and not yet swept jobs stay."""

from __future__ import annotations

import logging
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import Engine

from reconciler.config.settings import Settings
from reconciler.sidecar.service import Service
from reconciler.storage.engines import is_postgresql
from reconciler.storage.retention import (
    delete_finished_jobs,
    delete_finished_jobs_batch,
    scan_query,
)
from reconciler.storage.sql import actions, artifacts, attempts, jobs, steps
from tests.helpers import sidecar_service

RETENTION_DAYS = 30.0
PLAN = [{"step_name": "only", "effect_kind": "pure"}]


def insert_job(engine: Engine, status: str, *, finished_days_ago: float | None,
               artifact_state: str = "published", settled: bool = True) -> int:
    """A job of ``status`` with one step, one attempt, one artifact record and one operator
    action; ``finished_at`` that many days ago (None: not finished)."""
    now = datetime.now(UTC)
    created = now - timedelta(days=60)
    finished = None if finished_days_ago is None else now - timedelta(days=finished_days_ago)
    live = status == "processing"
    with engine.begin() as conn:
        job_id = int(conn.execute(jobs.insert().values(
            job_kind="report", job_status=status, step_plan=PLAN, max_attempts=3,
            attempt_count=1, claim_generation=1, available_at=created, created_at=created,
            updated_at=finished or now, finished_at=finished, claimed_at=created,
            last_activity_at=now if live else created,
            lease_token=uuid.uuid4().hex if live else None,
            lease_expires_at=now + timedelta(minutes=5) if live else None,
        ).returning(jobs.c.job_id)).scalar_one())
        conn.execute(steps.insert().values(
            job_id=job_id, step_index=0, step_name="only", effect_kind="pure",
            step_state="started" if live else "succeeded", claim_generation=1,
            started_at=created, finished_at=finished))
        conn.execute(attempts.insert().values(
            job_id=job_id, claim_generation=1, attempt_number=1, claimed_at=created,
            ended_at=finished, attempt_outcome=None if live else "completed",
            ended_by=None if live else "worker"))
        conn.execute(artifacts.insert().values(
            job_id=job_id, claim_generation=1, artifact_name="out.csv",
            artifact_state=artifact_state, staged_at=created,
            settled_at=finished if settled else None))
        conn.execute(actions.insert().values(
            job_id=job_id, job_key=str(job_id), operator_action="hold", action_outcome="applied",
            acted_at=created, status_before="queued", status_after="queued",
            generation_before=0, generation_after=0))
    return job_id


def job_ids(engine: Engine) -> set[int]:
    with engine.connect() as conn:
        return {int(i) for i in conn.execute(sa.select(jobs.c.job_id)).scalars()}


def child_job_ids(engine: Engine) -> dict[str, set[int]]:
    """For each child table, the jobs that still have rows there."""
    with engine.connect() as conn:
        return {t.name: {int(i) for i in conn.execute(sa.select(t.c.job_id)).scalars()}
                for t in (steps, attempts, artifacts, actions)}


def exported(service: Service, name: str) -> float:
    for family in text_string_to_metric_families(
            generate_latest(service.metrics.registry).decode()):
        for s in family.samples:
            if s.name == name:
                return float(s.value)
    raise AssertionError(f"{name} not exported")


def leading_service(db_url: str, **settings: Any) -> Service:
    service = sidecar_service(Settings(database_url=db_url, job_retention_days=RETENTION_DAYS,
                                       **settings), instance="job-retention-test")
    service.renew_leadership()  # retention is a chore of the leading replica
    assert service.leading
    return service


def test_old_finished_jobs_go_with_their_rows_and_live_and_recent_ones_stay(
    db_url: str, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """One chore run deletes completed, failed and cancelled jobs finished more than
    job_retention_days ago with every row of theirs, counts the rows in
    reconciler_job_rows_deleted_total and logs one line; it keeps running, queued, recent
    and not yet swept jobs."""
    old = {insert_job(engine, status, finished_days_ago=31)
           for status in ("completed", "failed", "cancelled")}
    kept = {
        insert_job(engine, "processing", finished_days_ago=None),
        # A retried job keeps no finished_at, but the status alone must protect it.
        insert_job(engine, "queued", finished_days_ago=31),
        insert_job(engine, "completed", finished_days_ago=29),
        # The artifact sweep still has work on these two: they wait for it.
        insert_job(engine, "failed", finished_days_ago=31, artifact_state="staged",
                   settled=False),
        insert_job(engine, "completed", finished_days_ago=31, settled=False),
    }
    service = leading_service(db_url)
    try:
        with caplog.at_level(logging.INFO, logger="reconciler.sidecar.service"):
            service.run_chore("job_retention")
            service.run_chore("job_retention")  # nothing left: no second line
        assert job_ids(engine) == kept
        assert not old & job_ids(engine)
        assert child_job_ids(engine) == dict.fromkeys(
            ("step_runs", "job_attempts", "job_artifacts", "operator_actions"), kept)
        # Three jobs, each with one row in each of four child tables.
        assert exported(service, "reconciler_job_rows_deleted_total") == 15.0
        lines = [r.getMessage() for r in caplog.records if "job_retention" in r.getMessage()]
        assert lines == ["event=job_retention_deleted jobs=3 rows=15 batches=1"]
    finally:
        service.close()


def test_a_replica_that_does_not_lead_deletes_nothing(db_url: str, engine: Engine) -> None:
    """Job retention is a chore of the leading replica only."""
    old = insert_job(engine, "completed", finished_days_ago=31)
    leader = leading_service(db_url)
    follower = sidecar_service(Settings(database_url=db_url,
                                        job_retention_days=RETENTION_DAYS), instance="follower")
    try:
        follower.renew_leadership()
        assert not follower.leading
        follower.run_chore("job_retention")
        assert job_ids(engine) == {old}
        assert exported(follower, "reconciler_job_rows_deleted_total") == 0.0
    finally:
        follower.close()
        leader.close()


def test_retention_deletes_in_bounded_batches_oldest_first(engine: Engine) -> None:
    """A batch deletes at most its size, oldest finished first, and says where the next
    starts; a run stops after max_batches and the next run carries on."""
    ages = [35, 34, 33, 32, 31]
    ids = [insert_job(engine, "completed", finished_days_ago=age) for age in ages]
    with engine.begin() as conn:
        first = delete_finished_jobs_batch(conn, RETENTION_DAYS, 2)
    assert (first.jobs_deleted, first.rows_deleted) == (2, 10)
    assert first.next_after is not None
    assert first.next_after[1] == ids[1]
    assert job_ids(engine) == set(ids[2:])

    run = delete_finished_jobs(engine, RETENTION_DAYS, batch_jobs=2, max_batches=1)
    assert (run.jobs_deleted, run.batches) == (2, 1)
    assert job_ids(engine) == {ids[4]}

    last = delete_finished_jobs(engine, RETENTION_DAYS, batch_jobs=2, max_batches=5)
    # One short batch ends the run.
    assert (last.jobs_deleted, last.rows_deleted, last.batches) == (1, 5, 1)
    assert job_ids(engine) == set()


def test_jobs_left_for_the_sweep_do_not_hold_back_older_ones(engine: Engine) -> None:
    """Jobs left for the artifact sweep never fill a batch: the old jobs behind them are
    deleted in full batches."""
    waiting = [insert_job(engine, "completed", finished_days_ago=40, artifact_state="staged",
                          settled=False) for _ in range(3)]
    behind = [insert_job(engine, "completed", finished_days_ago=35) for _ in range(4)]
    run = delete_finished_jobs(engine, RETENTION_DAYS, batch_jobs=2, max_batches=10)
    assert run.jobs_deleted == 4
    assert run.batches == 3  # two full batches, then an empty one
    assert job_ids(engine) == set(waiting)
    assert not set(behind) & job_ids(engine)


def test_a_job_retried_while_retention_runs_is_never_deleted(engine: Engine) -> None:
    """An operator retrying an old failed job while a retention run is under way wins: on
    PostgreSQL and MySQL the run skips the row the operator holds, on SQLite it waits for
    the operator's write; either way the job stays, queued, and the other old job goes."""
    retried = insert_job(engine, "failed", finished_days_ago=31)
    other = insert_job(engine, "completed", finished_days_ago=31)
    results: list[int] = []
    with engine.connect() as operator, operator.begin():
        # The operator's transaction holds the job (PostgreSQL, MySQL: its row lock; SQLite:
        # the write lock every write transaction takes at BEGIN IMMEDIATE).
        row_locks = operator.dialect.name != "sqlite"
        operator.execute(sa.select(jobs.c.job_id).where(jobs.c.job_id == retried)
                         .with_for_update() if row_locks else
                         sa.select(jobs.c.job_id).where(jobs.c.job_id == retried))
        run = threading.Thread(target=lambda: results.append(delete_finished_jobs(
            engine, RETENTION_DAYS, batch_jobs=10, max_batches=5).jobs_deleted))
        run.start()
        run.join(timeout=1.0 if row_locks else 0.3)
        operator.execute(jobs.update().where(jobs.c.job_id == retried)
                         .values(job_status="queued", finished_at=None))
    run.join(timeout=15)
    assert not run.is_alive()
    assert results == [1]
    assert job_ids(engine) == {retried}
    assert other not in job_ids(engine)
    with engine.connect() as conn:
        assert conn.execute(sa.select(jobs.c.job_status)
                            .where(jobs.c.job_id == retried)).scalar_one() == "queued"
    assert child_job_ids(engine)["step_runs"] == {retried}


def explain(engine: Engine, query: sa.Select[Any]) -> str:
    """The engine's plan for ``query``, as one text."""
    with engine.connect() as conn:
        compiled = query.compile(dialect=conn.dialect,
                                 compile_kwargs={"render_postcompile": True})
        params = compiled.construct_params()
        if conn.dialect.name == "mysql":  # the index it reads and how (filesort: a sort)
            rows = conn.exec_driver_sql(f"EXPLAIN {compiled}", params)
            return "\n".join(f"{r.key} {r.Extra}" for r in rows)
        if is_postgresql(conn):
            rows = conn.exec_driver_sql(f"EXPLAIN {compiled}", params)
        else:
            positional = tuple(params[name] for name in compiled.positiontup or ())
            rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}", positional)
        return "\n".join(str(r[-1]) for r in rows)


def test_the_scan_pages_the_index_of_finished_jobs_in_key_order(engine: Engine) -> None:
    """Among thousands of finished and running jobs, with the engine's statistics, the
    batch's scan reads ix_job_runs_finished_at in (finished_at, job_id) order, first page
    and next, with no sort: its cost follows the batch, not the table."""
    now = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(jobs.insert(), [
            {"job_kind": "bulk", "job_status": status, "max_attempts": 3,
             "available_at": now, "created_at": now, "updated_at": now,
             "finished_at": finished, "lease_token": token, "lease_expires_at": expires,
             "last_activity_at": now}
            for n in range(4000)
            for status, finished, token, expires in [
                ("processing", None, uuid.uuid4().hex, now) if n % 4 == 0 else
                ("completed", now - timedelta(days=10 + n / 100), None, None)]
        ])
        conn.exec_driver_sql("ANALYZE TABLE job_runs" if conn.dialect.name == "mysql"
                             else "ANALYZE")
    after = (now - timedelta(days=40), 1)
    for query in (scan_query(RETENTION_DAYS, 500), scan_query(RETENTION_DAYS, 500, after)):
        plan = explain(engine, query)
        assert "ix_job_runs_finished_at" in plan, plan
        assert "Sort" not in plan, plan
        assert "TEMP B-TREE" not in plan, plan
        assert "filesort" not in plan, plan
