"""The job systems ``benchmarks.foreign`` measures: each one's schema, data and own sweep.

A system is built in the reconciler's database, in its own schema, by its own code where it
has a migrator (Procrastinate's schema manager, graphile-worker's and pg-boss's Node
packages), then filled in bulk with set-based SQL: ``jobs`` rows, ``running`` of them
claimed, the first ``orphans`` of those on an owner that is alive until ``kill`` makes it
dead (a worker row silent for ten minutes, a lock five hours old, a start an hour before
an ``expire_in`` of fifteen minutes), the rest half waiting and half finished.

Each system's **peer** is the mechanism it ships for the same problem, run through its own
code on the same rows: Procrastinate's documented stalled-jobs recipe
(``get_stalled_jobs`` then ``retry_job`` each), graphile-worker's ``resetLockedAt()``,
pg-boss's maintenance expiry; the home-grown table's is the one-statement sweep such a
table usually has.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.foreign_base import (
    NODE_SCRIPTS,
    PEER_SWEEP,
    InDatabase,
    Size,
    System,
    bounds,
    execute,
    vacuum,
)

# --------------------------------------------------------------------------- #
# Procrastinate (Python): its schema manager, its recipe
# --------------------------------------------------------------------------- #


class Procrastinate(InDatabase):
    """Procrastinate 3.x in schema ``procrastinate``."""

    name = "procrastinate"
    user_index: str | None = None  # its own partial index on (status) covers the running jobs
    source_toml = ('[source]\nkind = "procrastinate"\nschema = "procrastinate"\n'
                   '[kinds."*"]\neffect = "idempotent"\n')
    schema = "procrastinate"

    def _app(self, conninfo: str) -> Any:
        import procrastinate  # noqa: PLC0415 - an optional extra, needed only here

        options = f"{conninfo} options='-c search_path={self.schema}'"
        return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=options))

    def build(self, conninfo: str, size: Size) -> None:
        execute(conninfo, f"CREATE SCHEMA {self.schema}")
        app = self._app(conninfo)

        async def apply() -> None:
            async with app.open_async():
                await app.schema_manager.apply_schema_async()

        asyncio.run(apply())
        path = f"SET search_path = {self.schema}"
        execute(
            conninfo, path,
            "INSERT INTO procrastinate_workers (id, last_heartbeat) OVERRIDING SYSTEM VALUE "
            "VALUES (1, now()), (2, now())",
            "ALTER TABLE procrastinate_jobs DISABLE TRIGGER USER",
            """INSERT INTO procrastinate_jobs (id, queue_name, task_name, status, attempts,
                                               worker_id)
               SELECT n, 'default', 'report',
                   (CASE WHEN n <= %(running)s THEN 'doing' WHEN n <= %(waiting_end)s
                    THEN 'todo' ELSE 'succeeded' END)::procrastinate_job_status,
                   CASE WHEN n > %(running)s AND n <= %(waiting_end)s THEN 0 ELSE 1 END,
                   CASE WHEN n <= %(orphans)s THEN 1 WHEN n <= %(running)s THEN 2 END
               FROM generate_series(1, %(jobs)s::bigint) AS s(n)""",
            """INSERT INTO procrastinate_events (job_id, type)
               SELECT id, e.type FROM procrastinate_jobs CROSS JOIN LATERAL unnest((CASE
                   status WHEN 'todo' THEN '{deferred}' WHEN 'doing' THEN '{deferred,started}'
                   ELSE '{deferred,started,succeeded}' END)::procrastinate_job_event_type[])
                   AS e(type)""",
            "ALTER TABLE procrastinate_jobs ENABLE TRIGGER USER",
            "SELECT setval(pg_get_serial_sequence('procrastinate_jobs', 'id'), %(jobs)s)",
            params=bounds(size))
        vacuum(conninfo, f"{self.schema}.procrastinate_jobs, {self.schema}.procrastinate_events,"
                         f" {self.schema}.procrastinate_workers")

    def kill(self, conninfo: str, size: Size) -> None:
        execute(conninfo, f"SET search_path = {self.schema}",
                 "UPDATE procrastinate_workers SET last_heartbeat = now() - interval '10 minutes'"
                 " WHERE id = 1",
                 "UPDATE procrastinate_jobs SET status = 'doing', attempts = 1, worker_id = 1 "
                 "WHERE id <= %(orphans)s", params=bounds(size))

    def keep_alive(self, conninfo: str) -> None:
        execute(conninfo, f"UPDATE {self.schema}.procrastinate_workers "
                           "SET last_heartbeat = now()")

    def _heartbeat(self, conninfo: str) -> None:
        """The live worker heartbeats, as it does every few seconds."""
        execute(conninfo, f"UPDATE {self.schema}.procrastinate_workers "
                           "SET last_heartbeat = now() WHERE id = 2")

    def peer_quiet(self, conninfo: str, runs: int) -> list[float]:
        app = self._app(conninfo)

        async def measure() -> list[float]:
            samples = []
            async with app.open_async():
                for _ in range(runs + 1):
                    started = time.perf_counter()
                    stalled = list(await app.job_manager.get_stalled_jobs(
                        seconds_since_heartbeat=30))
                    samples.append((time.perf_counter() - started) * 1000)
                    if stalled:
                        raise RuntimeError("Procrastinate's quiet sweep found stalled jobs")
            return samples[1:]

        self._heartbeat(conninfo)
        return asyncio.run(measure())

    def peer_recover(self, conninfo: str, size: Size) -> tuple[float, int]:
        app = self._app(conninfo)

        async def recover() -> tuple[float, int]:
            async with app.open_async():
                started = time.perf_counter()
                stalled = list(await app.job_manager.get_stalled_jobs(
                    seconds_since_heartbeat=30))
                for job in stalled:
                    await app.job_manager.retry_job(job)
                return time.perf_counter() - started, len(stalled)

        self._heartbeat(conninfo)
        return asyncio.run(recover())


# --------------------------------------------------------------------------- #
# graphile-worker and pg-boss (Node): migrated and swept by their own packages
# --------------------------------------------------------------------------- #


def node_modules() -> Path:
    """graphile-worker and pg-boss from npm, in the folder the source tests install once."""
    from tests.sources.conftest import (  # noqa: PLC0415 - the versions the tests pin
        GRAPHILE_WORKER_VERSION,
        PG_BOSS_VERSION,
    )

    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise SystemExit("graphile-worker and pg-boss need node and npm: "
                         "apt-get install nodejs npm")
    folder = (Path(tempfile.gettempdir()) / "reconciler-test-npm" /
              f"graphile-worker-{GRAPHILE_WORKER_VERSION}-pg-boss-{PG_BOSS_VERSION}")
    if not (folder / "node_modules" / "pg-boss").exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "package.json").write_text(json.dumps({"private": True}))
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--loglevel=error",
                        f"graphile-worker@{GRAPHILE_WORKER_VERSION}",
                        f"pg-boss@{PG_BOSS_VERSION}"], cwd=folder, check=True, timeout=600)
    return folder / "node_modules"


def libpq_url(conninfo: str) -> str:
    """``postgresql://user@host:port/dbname`` for a libpq key-value string."""
    parts = dict(item.split("=", 1) for item in conninfo.split())
    return (f"postgresql://{parts.get('user', 'postgres')}@{parts.get('host', '127.0.0.1')}:"
            f"{parts.get('port', '5432')}/{parts.get('dbname', 'postgres')}")


def _node(script: Path, conninfo: str, *args: str) -> str:
    node = shutil.which("node")
    assert node is not None
    env = {**os.environ, "NODE_PATH": str(node_modules()),
           "SOURCES_PG_CONNINFO": libpq_url(conninfo), "PEER_PG_CONNINFO": libpq_url(conninfo),
           "SOURCES_MARKERS": tempfile.gettempdir()}
    done = subprocess.run([node, str(script), *args], capture_output=True, text=True,
                          env=env, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"node {script.name} {' '.join(args)}: {done.stderr[-800:]}")
    return done.stdout


class NodeSystem(InDatabase):
    """What graphile-worker and pg-boss share: a migrate script and a timed Node sweep."""

    name: str
    schema: str
    runner: str

    def keep_alive(self, conninfo: str) -> None:
        """No heartbeats: liveness is the claim's age."""

    def _migrate(self, conninfo: str) -> None:
        _node(NODE_SCRIPTS / self.runner, conninfo, "migrate")

    def peer_quiet(self, conninfo: str, runs: int) -> list[float]:
        samples: list[float] = json.loads(
            _node(PEER_SWEEP, conninfo, self.name, self.schema, str(runs + 1)))
        return samples[1:]

    def peer_recover(self, conninfo: str, size: Size) -> tuple[float, int]:
        [ms] = json.loads(_node(PEER_SWEEP, conninfo, self.name, self.schema, "1"))
        return ms / 1000, self.recovered_by_peer(conninfo, size)

    def recovered_by_peer(self, conninfo: str, size: Size) -> int:
        raise NotImplementedError


class GraphileWorker(NodeSystem):
    """graphile-worker 0.17 in schema ``graphile_worker``; jobs in no named queue."""

    name = "graphile-worker"
    user_index: str | None = ("CREATE INDEX jobs_reconciler_locked ON "
                              "graphile_worker._private_jobs (locked_at) "
                              "WHERE locked_at IS NOT NULL")
    schema = "graphile_worker"
    runner = "graphile_worker_runner.js"
    source_toml = ('[source]\nkind = "graphile-worker"\n[kinds."*"]\neffect = "idempotent"\n')

    def build(self, conninfo: str, size: Size) -> None:
        self._migrate(conninfo)
        execute(
            conninfo, f"SET search_path = {self.schema}",
            "INSERT INTO _private_tasks (identifier) VALUES ('report')",
            """INSERT INTO _private_jobs (task_id, run_at, attempts, max_attempts, locked_at,
                                          locked_by)
               SELECT t.id, now(),
                   CASE WHEN n <= %(running)s THEN 1 ELSE 0 END, 25,
                   CASE WHEN n <= %(running)s THEN now() END,
                   CASE WHEN n <= %(running)s THEN 'pool-live' END
               FROM generate_series(1, %(jobs)s::bigint) AS s(n), _private_tasks t""",
            # graphile-worker deletes a job when it completes: "finished" rows do not exist,
            # so the rest are all waiting (a larger backlog than the other systems carry).
            params=bounds(size))
        vacuum(conninfo, f"{self.schema}._private_jobs")

    def kill(self, conninfo: str, size: Size) -> None:
        execute(conninfo,
                 f"UPDATE {self.schema}._private_jobs SET attempts = 1, locked_by = 'pool-dead',"
                 " locked_at = now() - make_interval(secs => %(dead)s) WHERE id <= %(orphans)s",
                 params=bounds(size))

    def recovered_by_peer(self, conninfo: str, size: Size) -> int:
        with psycopg.connect(conninfo) as conn:
            row = conn.execute(f"SELECT count(*) FROM {self.schema}._private_jobs "  # type: ignore[arg-type]
                               "WHERE id <= %(orphans)s AND locked_at IS NULL",
                               bounds(size)).fetchone()
        assert row is not None
        return int(row[0])


class PgBoss(NodeSystem):
    """pg-boss 10 in schema ``pgboss``; one queue, ``report``, standard policy."""

    name = "pg-boss"
    user_index: str | None = ("CREATE INDEX job_reconciler_active ON pgboss.job "
                              "(name, started_on) WHERE state = 'active'")
    schema = "pgboss"
    runner = "pgboss_runner.js"
    source_toml = '[source]\nkind = "pg-boss"\n[kinds."*"]\neffect = "idempotent"\n'

    def build(self, conninfo: str, size: Size) -> None:
        self._migrate(conninfo)
        execute(
            conninfo, f"SET search_path = {self.schema}",
            "SELECT create_queue('report', '{\"policy\": \"standard\"}')",
            """INSERT INTO job (name, state, retry_limit, retry_count, started_on, expire_in,
                                completed_on, policy)
               SELECT 'report',
                   (CASE WHEN n <= %(running)s THEN 'active' WHEN n <= %(waiting_end)s
                    THEN 'created' ELSE 'completed' END)::job_state,
                   2, 0,
                   CASE WHEN n <= %(running)s OR n > %(waiting_end)s THEN now() END,
                   interval '15 minutes',
                   CASE WHEN n > %(waiting_end)s THEN now() END, 'standard'
               FROM generate_series(1, %(jobs)s::bigint) AS s(n)""",
            params=bounds(size))
        execute(conninfo, f"CREATE TABLE {self.schema}.bench_orphans AS SELECT id FROM "
                           f"{self.schema}.job WHERE state = 'active' ORDER BY id "
                           "LIMIT %(orphans)s", params=bounds(size))
        vacuum(conninfo, f"{self.schema}.job")

    def kill(self, conninfo: str, size: Size) -> None:
        # pg-boss's expiry deletes and re-inserts a job it retries: the ids stay.
        execute(conninfo,
                 f"UPDATE {self.schema}.job SET state = 'active', retry_count = 0, "
                 "started_on = now() - make_interval(secs => %(dead)s), completed_on = NULL, "
                 f"output = NULL WHERE id IN (SELECT id FROM {self.schema}.bench_orphans)",
                 params=bounds(size))

    def recovered_by_peer(self, conninfo: str, size: Size) -> int:
        with psycopg.connect(conninfo) as conn:
            row = conn.execute(f"SELECT count(*) FROM {self.schema}.job WHERE state = 'retry' "  # type: ignore[arg-type]
                               f"AND id IN (SELECT id FROM {self.schema}.bench_orphans)"
                               ).fetchone()
        assert row is not None
        return int(row[0])


# --------------------------------------------------------------------------- #
# A home-grown table
# --------------------------------------------------------------------------- #


class OneStatementSweep(InDatabase):
    """A system whose peer is the one ``UPDATE`` a team writes for want of its own."""

    name: str
    sweep: str
    """The ``UPDATE`` that puts every expired claim back."""

    def peer_quiet(self, conninfo: str, runs: int) -> list[float]:
        samples = []
        with psycopg.connect(conninfo, autocommit=True) as conn:
            for _ in range(runs + 1):
                started = time.perf_counter()
                if conn.execute(self.sweep).rowcount:  # type: ignore[arg-type]
                    raise RuntimeError(f"{self.name}'s quiet sweep found expired claims")
                samples.append((time.perf_counter() - started) * 1000)
        return samples[1:]

    def peer_recover(self, conninfo: str, size: Size) -> tuple[float, int]:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            started = time.perf_counter()
            recovered = conn.execute(self.sweep).rowcount  # type: ignore[arg-type]
            return time.perf_counter() - started, recovered


class HomeGrownTable(OneStatementSweep):
    """A job table as teams write them: status, kind, lease, owner, attempts; indexed on
    status, as such a table's own claim query needs."""

    name = "table"
    user_index: str | None = ("CREATE INDEX jobs_reconciler_running ON app.jobs (id) "
                              "WHERE status = 'processing'")
    source_toml = ('[source]\nkind = "table"\ntable = "jobs"\nschema = "app"\n'
                   'id_column = "id"\nstatus_column = "status"\nprocessing = "processing"\n'
                   'queued = "pending"\nfailed = "failed"\nkind_column = "job_type"\n'
                   'lease_expires_column = "lease_until"\nowner_column = "claimed_by"\n'
                   'attempts_column = "attempts"\nreason_column = "status_reason"\n'
                   '[kinds."*"]\neffect = "idempotent"\nmax_attempts = 25\n')
    sweep = ("UPDATE app.jobs SET status = 'pending', claimed_by = NULL, lease_until = NULL "
             "WHERE status = 'processing' AND lease_until < now()")

    def build(self, conninfo: str, size: Size) -> None:
        execute(
            conninfo, "CREATE SCHEMA app",
            """CREATE TABLE app.jobs (id bigint PRIMARY KEY, job_type text NOT NULL,
                   status text NOT NULL, status_reason text, lease_until timestamptz,
                   claimed_by text, attempts int NOT NULL DEFAULT 0, payload jsonb)""",
            """INSERT INTO app.jobs (id, job_type, status, lease_until, claimed_by, attempts)
               SELECT n, 'report',
                   CASE WHEN n <= %(running)s THEN 'processing' WHEN n <= %(waiting_end)s
                   THEN 'pending' ELSE 'done' END,
                   CASE WHEN n <= %(running)s THEN now() + interval '1 hour' END,
                   CASE WHEN n <= %(running)s THEN 'host-' || (n %% 8) END,
                   CASE WHEN n > %(running)s AND n <= %(waiting_end)s THEN 0 ELSE 1 END
               FROM generate_series(1, %(jobs)s::bigint) AS s(n)""",
            "CREATE INDEX jobs_status_index ON app.jobs (status)",
            params=bounds(size))
        vacuum(conninfo, "app.jobs")

    def keep_alive(self, conninfo: str) -> None:
        """Leases run an hour from the build."""

    def kill(self, conninfo: str, size: Size) -> None:
        execute(conninfo, "UPDATE app.jobs SET status = 'processing', attempts = 1, "
                           "claimed_by = 'host-dead', lease_until = now() - interval '1 hour' "
                           "WHERE id <= %(orphans)s", params=bounds(size))



SYSTEMS: dict[str, type[System]] = {  # type: ignore[dict-item]
    "procrastinate": Procrastinate,
    "graphile-worker": GraphileWorker,
    "pg-boss": PgBoss,
    "table": HomeGrownTable,
}
