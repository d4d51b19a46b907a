"""Fixture factories that put a real system's jobs in the states a source must judge.

Each factory writes through the system's own functions where it has them (Procrastinate's
defer, register and fetch functions; graphile-worker's ``add_job`` and its claim; pg-boss's
``create_queue`` and its fetch), then moves the claim's clock back to make an owner silent
or a lease run out, the way time would. Every factory offers the same methods, so a suite
(the conformance suite among them) can run unchanged against each:

- ``died(kind, attempts_used=1, steps=None)``: claimed, then its worker died long ago;
  ``steps`` records step-ledger states for the running attempt, e.g.
  ``[("fetch", "idempotent", "succeeded"), ("charge", "effectful", None)]`` (None: never
  started), so "died before a step" and "died mid-step" are both one call;
- ``live(kind)``: claimed by a worker that is alive (heartbeating, or inside its lease);
- ``exhausted(kind)``: died on its last attempt;
- ``queued(kind)``: waiting, never claimed;
- ``status(job)``: ``queued`` | ``running`` | ``failed`` | ``completed`` | ``absent``;
- ``attempts_used(job)``, ``error_text(job)`` (our reason where the system keeps one);
- ``open_source(conn, kinds, lock=True)``: the source under test.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.config.loader import SourceConfig
from reconciler.core.kinds import KindRules
from reconciler.core.ports import JobKey
from reconciler.ledger import Step, StepLedger
from reconciler.sources import graphile_worker, pgboss, procrastinate
from reconciler.sources.graphile_worker import GraphileWorkerConfig
from reconciler.sources.kit.source import DeclaredSource
from reconciler.sources.pgboss import PgBossConfig
from reconciler.sources.procrastinate import ProcrastinateConfig
from tests.sources.conftest import SourcesDatabase

StepSpec = tuple[str, str, str | None]
"""(step name, effect kind, state: "succeeded" | "started" | "failed" | None)."""

LONG_AGO_SECONDS = 6 * 3600  # beyond every lease these tests use (graphile-worker's 4 h too)
SESSION_TIMEOUT_SECONDS = 2.0


class SystemFactory(Protocol):
    """What a suite needs of one system's fixtures."""

    source_name: str
    default_max_attempts: int
    db: SourcesDatabase
    config: SourceConfig

    def open_source(self, conn: Connection, kinds: KindRules, *,
                    lock: bool = True) -> DeclaredSource: ...
    def died(self, kind: str, *, attempts_used: int = 1,
             steps: Sequence[StepSpec] | None = None) -> JobKey: ...
    def live(self, kind: str) -> JobKey: ...
    def exhausted(self, kind: str) -> JobKey: ...
    def queued(self, kind: str) -> JobKey: ...
    def status(self, job: JobKey) -> str: ...
    def attempts_used(self, job: JobKey) -> int: ...
    def error_text(self, job: JobKey) -> str | None: ...


def record_steps(db: SourcesDatabase, source_name: str, job: JobKey, attempt: int,
                 steps: Sequence[StepSpec], *, age: float = LONG_AGO_SECONDS) -> None:
    """Record step states through the real step ledger, as the job's task would have,
    ``age`` seconds ago (a dead worker's last records are as old as its death)."""
    with StepLedger(db.engine) as ledger:
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
            # "started": the worker died inside the step; the block never ends.
    with db.engine.begin() as conn:
        conn.execute(sa.text(
            "UPDATE step_ledger_entries SET updated_at = updated_at - make_interval(secs => :a),"
            " started_at = started_at - make_interval(secs => :a), finished_at = finished_at"
            " - make_interval(secs => :a) WHERE source_name = :s AND job_key = :k"),
            {"a": age, "s": source_name, "k": str(job)})


class ProcrastinateFactory:
    """Procrastinate jobs in schema ``procrastinate``; workers heartbeat in its table."""

    source_name = "procrastinate"
    default_max_attempts = 3

    def __init__(self, db: SourcesDatabase, schema: str,
                 session_timeout_seconds: float = SESSION_TIMEOUT_SECONDS) -> None:
        self.db, self.schema = db, schema
        self.config = ProcrastinateConfig(schema=schema,
                                          session_timeout_seconds=session_timeout_seconds)
        self._queues = 0

    def open_source(self, conn: Connection, kinds: KindRules, *,
                    lock: bool = True) -> DeclaredSource:
        return procrastinate.DECLARATION.open(conn, self.config, kinds, lock=lock)

    def _sql(self, sql: str, params: dict[str, Any] | None = None) -> list[Any]:
        with self.db.engine.begin() as conn:
            conn.execute(sa.text("SELECT set_config('search_path', :p, true)"),
                         {"p": f"{self.schema}, public"})
            result = conn.execute(sa.text(sql), params or {})
            return list(result) if result.returns_rows else []

    def defer(self, kind: str, args: dict[str, Any] | None = None) -> int:
        """A ``todo`` job in a queue of its own (so a fetch takes exactly this job)."""
        self._queues += 1
        [(job_id,)] = self._sql(
            "SELECT unnest(procrastinate_defer_jobs_v1(ARRAY[ROW(:queue, :task, 0, NULL, "
            "NULL, CAST(:args AS jsonb), NULL)::procrastinate_job_to_defer_v1]))",
            {"queue": f"q{self._queues}", "task": kind, "args": json.dumps(args or {})})
        return int(job_id)

    def claim(self, job: int, *, heartbeat_age: float, attempts_before: int = 0) -> int:
        """Fetch the job with a freshly registered worker whose heartbeat is this old."""
        [(worker,)] = self._sql("SELECT worker_id FROM procrastinate_register_worker_v1()")
        self._sql("UPDATE procrastinate_jobs SET attempts = :a WHERE id = :id",
                  {"a": attempts_before, "id": job})
        [(queue,)] = self._sql("SELECT queue_name FROM procrastinate_jobs WHERE id = :id",
                               {"id": job})
        [(fetched,)] = self._sql("SELECT id FROM procrastinate_fetch_job_v2(ARRAY[:q], :w)",
                                 {"q": queue, "w": worker})
        assert fetched == job
        self._sql("UPDATE procrastinate_workers SET last_heartbeat = now() - "
                  "make_interval(secs => :age) WHERE id = :w", {"age": heartbeat_age, "w": worker})
        return int(worker)

    def died(self, kind: str, *, attempts_used: int = 1,
             steps: Sequence[StepSpec] | None = None) -> int:
        job = self.defer(kind)
        self.claim(job, heartbeat_age=LONG_AGO_SECONDS, attempts_before=attempts_used - 1)
        if steps:
            record_steps(self.db, self.source_name, job, attempts_used - 1, steps)
        return job

    def died_unregistered(self, kind: str) -> int:
        """Its worker's row is gone altogether (pruned by another worker): ``worker_id`` NULL."""
        job = self.defer(kind)
        worker = self.claim(job, heartbeat_age=0)
        self._sql("SELECT procrastinate_prune_stalled_workers_v1(-1)")
        assert self._sql("SELECT worker_id FROM procrastinate_jobs WHERE id = :id",
                         {"id": job}) == [(None,)]
        del worker
        return job

    def live(self, kind: str) -> int:
        job = self.defer(kind)
        self.claim(job, heartbeat_age=0)
        return job

    def exhausted(self, kind: str) -> int:
        return self.died(kind, attempts_used=self.default_max_attempts)

    def queued(self, kind: str) -> int:
        return self.defer(kind)

    def row(self, job: JobKey) -> dict[str, Any] | None:
        rows = self._sql("SELECT status::text AS status, attempts, worker_id FROM "
                         "procrastinate_jobs WHERE id = :id", {"id": job})
        return dict(rows[0]._mapping) if rows else None

    def status(self, job: JobKey) -> str:
        row = self.row(job)
        if row is None:
            return "absent"
        return {"todo": "queued", "doing": "running", "failed": "failed",
                "succeeded": "completed"}.get(row["status"], row["status"])

    def attempts_used(self, job: JobKey) -> int:
        row = self.row(job)
        assert row is not None
        # attempts counts finished attempts; a running one is in use too.
        return int(row["attempts"]) + (1 if row["status"] == "doing" else 0)

    def error_text(self, job: JobKey) -> str | None:
        return None  # Procrastinate keeps no error field

    def events(self, job: JobKey) -> list[str]:
        """The job's event history, oldest first (Procrastinate's own triggers write it)."""
        return [r.type for r in self._sql("SELECT type::text AS type FROM procrastinate_events "
                                          "WHERE job_id = :id ORDER BY id", {"id": job})]


class GraphileWorkerFactory:
    """graphile-worker jobs in schema ``graphile_worker``, claimed as its workers claim."""

    source_name = "graphile-worker"
    default_max_attempts = 3

    def __init__(self, db: SourcesDatabase, schema: str) -> None:
        self.db, self.schema = db, schema
        self.config = GraphileWorkerConfig(schema=schema)

    def open_source(self, conn: Connection, kinds: KindRules, *,
                    lock: bool = True) -> DeclaredSource:
        return graphile_worker.DECLARATION.open(conn, self.config, kinds, lock=lock)

    def _sql(self, sql: str, params: dict[str, Any] | None = None) -> list[Any]:
        with self.db.engine.begin() as conn:
            conn.execute(sa.text("SELECT set_config('search_path', :p, true)"),
                         {"p": f"{self.schema}, public"})
            result = conn.execute(sa.text(sql), params or {})
            return list(result) if result.returns_rows else []

    def add(self, kind: str, payload: dict[str, Any] | None = None, *,
            queue: str | None = None, max_attempts: int | None = None) -> int:
        """A job added with graphile-worker's own ``add_job``."""
        [(job,)] = self._sql(
            "SELECT id FROM add_job(:task, CAST(:payload AS json), queue_name => :queue, "
            "max_attempts => :max)",
            {"task": kind, "payload": json.dumps(payload or {}), "queue": queue,
             "max": max_attempts or self.default_max_attempts})
        return int(job)

    def claim(self, job: int, *, age: float, attempts_before: int = 0,
              pool: str | None = None) -> str:
        """Lock the job (and its queue) as a worker pool's claim does, ``age`` seconds ago."""
        pool = pool or f"worker-{uuid.uuid4().hex[:8]}"
        self._sql("UPDATE _private_jobs SET attempts = :a + 1, locked_by = :pool, "
                  "locked_at = now() - make_interval(secs => :age) WHERE id = :id",
                  {"a": attempts_before, "pool": pool, "age": age, "id": job})
        self._sql("UPDATE _private_job_queues q SET locked_by = :pool, locked_at = "
                  "now() - make_interval(secs => :age) FROM _private_jobs j "
                  "WHERE j.id = :id AND q.id = j.job_queue_id",
                  {"pool": pool, "age": age, "id": job})
        return pool

    def died(self, kind: str, *, attempts_used: int = 1,
             steps: Sequence[StepSpec] | None = None, queue: str | None = None) -> int:
        job = self.add(kind, queue=queue)
        self.claim(job, age=LONG_AGO_SECONDS, attempts_before=attempts_used - 1)
        if steps:
            record_steps(self.db, self.source_name, job, attempts_used, steps)
        return job

    def live(self, kind: str) -> int:
        job = self.add(kind)
        self.claim(job, age=0)
        return job

    def exhausted(self, kind: str) -> int:
        return self.died(kind, attempts_used=self.default_max_attempts)

    def queued(self, kind: str) -> int:
        return self.add(kind)

    def row(self, job: JobKey) -> dict[str, Any] | None:
        rows = self._sql("SELECT locked_at, locked_by, attempts, max_attempts, last_error, "
                         "run_at <= now() AS runnable, job_queue_id FROM _private_jobs "
                         "WHERE id = :id", {"id": job})
        return dict(rows[0]._mapping) if rows else None

    def queue_locked(self, job: JobKey) -> bool:
        rows = self._sql("SELECT q.locked_at IS NOT NULL FROM _private_job_queues q "
                         "JOIN _private_jobs j ON j.job_queue_id = q.id WHERE j.id = :id",
                         {"id": job})
        return bool(rows and rows[0][0])

    def status(self, job: JobKey) -> str:
        row = self.row(job)
        if row is None:
            return "absent"  # graphile-worker deletes a job when it completes
        if row["locked_at"] is not None:
            return "running"
        return "failed" if row["attempts"] >= row["max_attempts"] else "queued"

    def attempts_used(self, job: JobKey) -> int:
        row = self.row(job)
        assert row is not None
        return int(row["attempts"])

    def error_text(self, job: JobKey) -> str | None:
        row = self.row(job)
        return None if row is None else row["last_error"]


class PgBossFactory:
    """pg-boss jobs in schema ``pgboss``, each kind a queue created by its own function."""

    source_name = "pg-boss"
    default_max_attempts = 3  # retry_limit 2, pg-boss's default

    def __init__(self, db: SourcesDatabase, schema: str) -> None:
        self.db, self.schema = db, schema
        self.config = PgBossConfig(schema=schema)
        self._queues: set[str] = set()

    def open_source(self, conn: Connection, kinds: KindRules, *,
                    lock: bool = True) -> DeclaredSource:
        return pgboss.DECLARATION.open(conn, self.config, kinds, lock=lock)

    def _sql(self, sql: str, params: dict[str, Any] | None = None) -> list[Any]:
        with self.db.engine.begin() as conn:
            conn.execute(sa.text("SELECT set_config('search_path', :p, true)"),
                         {"p": f"{self.schema}, public"})
            result = conn.execute(sa.text(sql), params or {})
            return list(result) if result.returns_rows else []

    def queue(self, name: str, *, policy: str = "standard",
              dead_letter: str | None = None) -> None:
        """Create the queue (and its partition) with pg-boss's own ``create_queue``."""
        if name in self._queues:
            return
        options = {"policy": policy, **({"deadLetter": dead_letter} if dead_letter else {})}
        self._sql("SELECT create_queue(:name, CAST(:options AS json))",
                  {"name": name, "options": json.dumps(options)})
        self._queues.add(name)

    def send(self, kind: str, data: dict[str, Any] | None = None, *,
             retry_limit: int = 2, expire_seconds: int = 900,
             singleton_key: str | None = None) -> str:
        """A job as pg-boss's ``send`` inserts it (the queue's policy copied onto the job)."""
        self.queue(kind)
        [(job,)] = self._sql(
            "INSERT INTO job (name, data, retry_limit, expire_in, singleton_key, policy, "
            "dead_letter) SELECT q.name, CAST(:data AS jsonb), :retries, "
            "make_interval(secs => :expire), :key, q.policy, q.dead_letter FROM queue q "
            "WHERE q.name = :name RETURNING id::text",
            {"name": kind, "data": json.dumps(data or {}), "retries": retry_limit,
             "expire": expire_seconds, "key": singleton_key})
        return str(job)

    def claim(self, job: str, *, age: float, retries_before: int = 0) -> None:
        """Fetch as pg-boss does (active, started_on, retry_count), ``age`` seconds ago."""
        self._sql("UPDATE job SET state = 'active', retry_count = :r, "
                  "started_on = now() - make_interval(secs => :age) WHERE id = CAST(:id AS uuid)",
                  {"r": retries_before, "age": age, "id": job})

    def died(self, kind: str, *, attempts_used: int = 1,
             steps: Sequence[StepSpec] | None = None) -> str:
        job = self.send(kind)
        self.claim(job, age=LONG_AGO_SECONDS, retries_before=attempts_used - 1)
        if steps:
            record_steps(self.db, self.source_name, job, attempts_used - 1, steps)
        return job

    def live(self, kind: str) -> str:
        job = self.send(kind)
        self.claim(job, age=0)
        return job

    def exhausted(self, kind: str) -> str:
        return self.died(kind, attempts_used=self.default_max_attempts)

    def queued(self, kind: str) -> str:
        return self.send(kind)

    def row(self, job: JobKey) -> dict[str, Any] | None:
        rows = self._sql("SELECT state::text AS state, retry_count, retry_limit, output, "
                         "started_on, start_after <= now() AS runnable, name FROM job "
                         "WHERE id = CAST(:id AS uuid)", {"id": job})
        return dict(rows[0]._mapping) if rows else None

    def status(self, job: JobKey) -> str:
        row = self.row(job)
        if row is None:
            return "absent"
        return {"created": "queued", "retry": "queued", "active": "running"}.get(
            row["state"], row["state"])

    def attempts_used(self, job: JobKey) -> int:
        row = self.row(job)
        assert row is not None
        # A fetch after a first start counts the retry; a running job is in its own.
        return int(row["retry_count"]) + 1

    def error_text(self, job: JobKey) -> str | None:
        row = self.row(job)
        if row is None or row["output"] is None:
            return None
        return str(row["output"].get("reason"))
