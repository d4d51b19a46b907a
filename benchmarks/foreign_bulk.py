"""Each foreign source's bulk retry, beside the system's own tool for retrying many jobs.

    python -m benchmarks.foreign_bulk [--source rq|procrastinate|pg-boss|all]
        [--jobs N] [--smoke] [--json]

For each system, on a throwaway PostgreSQL 15 (tests/pg_server.py) holding the
reconciler's own tables (and Procrastinate's or pg-boss's schema; RQ's keys are on a
throwaway redis-server), 2N jobs are built in bulk in the system's own shape as a worker
that died mid-task leaves them (``benchmarks.rq_jobs.RqJobs``: RQ's own classes, written
in pipelines, every worker then gone and its registry entry expired;
``benchmarks.foreign_systems.Procrastinate``: its schema manager, then set-based SQL,
every job ``doing`` on a worker whose heartbeat is ten minutes old;
``benchmarks.foreign_systems.PgBoss``: its own migration through Node, then set-based
SQL, every job ``active`` in queue ``report``, started five hours before its 15-minute
``expire_in``). The reconciler's real passes (``benchmarks.bulk_retry``'s
``terminalize``, every kind effectful, the brake off) then fail all 2N
``worker_died_mid_step`` in the system's own failed shape (RQ's ``handle_job_failure``:
``failed``, in the queue's failed registry; Procrastinate's
``procrastinate_finish_job_v1(id, 'failed')``; pg-boss's ``fail``: ``failed``), each
decision in the audit, and the benchmark checks that all 2N are failed. Then, on the same
rows, one after the other:

- ``value`` (ours): ``reconciler jobs retry --reason worker_died_mid_step --limit N --yes``
  as the command line runs it (``reconciler.cli.bulk.bulk_action`` on the desk
  ``assemble_cli`` builds: ``bulk_targets`` chooses N of the 2N by their latest decision,
  then ``act_on_chunk`` a chunk of ``BULK_CHUNK`` at a time through the source's
  ``BatchActions``, each job fenced on what was read, every action recorded). Checked:
  N applied, N recorded, exactly N in the system's queued state and N still failed.
- ``peer_value`` (theirs): the system's own tool retrying the other N, which are the
  only jobs still failed:

  - RQ: ``rq requeue --all --queue Q`` (its command line, run in process through its
    click command, once per queue of the four), which reads the queue's failed registry
    and calls ``FailedJobRegistry.requeue`` for each id: RQ 2.x has no requeue of many
    ids in one call, so its command's loop is its bulk path.
  - Procrastinate: it has no bulk retry and its command line no retry at all (its
    ``shell``'s ``retry`` takes one id). Its bulk path is the Django admin's "Retry Job"
    action over the jobs selected: ``JobManager.retry_job_by_id`` for each job (one call
    of ``procrastinate_retry_job_v2`` each). The benchmark runs that loop without Django:
    one ``SELECT`` of the failed ids (the admin's queryset filter), then
    ``retry_job_by_id(id, now)`` on a ``SyncPsycopgConnector``.
  - pg-boss: ``boss.retry(queue, ids)`` with all N ids, its retry of many ids in one call
    (one ``UPDATE``), after one ``SELECT`` of the failed ids (pg-boss lists none itself),
    through Node (benchmarks/node/peer_retry.js), timed inside Node once pg-boss has
    started.

  Checked: all 2N jobs in the system's queued state (RQ: ``queued`` and on their queue's
  list; Procrastinate: ``todo``, runnable now; pg-boss: ``retry``, runnable now).

Why the baseline is fair: both sides start from jobs built and failed the same way in the
same run, on the same servers, N each, from a system that holds 2N; each side's time
includes choosing its jobs (ours from the audit, theirs from the system's failed set).
Procrastinate's tables are vacuumed before each side, so neither pays for the dead rows
the other left (pg-boss's too). Ours does more per job than theirs: a fence checked on
each job, an ``operator_actions`` row recorded, and a fresh attempt budget; RQ's requeue,
Procrastinate's retry and pg-boss's retry check only the job's status. ``ratio_to_peer``
is ours over theirs (above 1: ours is faster). Ratios, not absolute rates, carry over
between machines. Each row also has ``statements_per_job`` (what ours sent to the
reconciler's database per job) and ``terminalize`` (the passes' rate over the 2N, jobs/s,
for scale).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psycopg
from sqlalchemy.engine import Engine

from benchmarks.bulk_retry import BATCH_SIZE, NO_BRAKE, _bulk, _recorded, _terminalize
from benchmarks.foreign_base import Size, vacuum
from benchmarks.foreign_python import start_redis
from benchmarks.foreign_systems import PgBoss, Procrastinate, _node
from benchmarks.harness import row_printer
from benchmarks.rq_jobs import QUEUES, RqJobs
from reconciler.config.loader import config_from
from reconciler.core.vocabulary import OperatorAction
from reconciler.root.cli import assemble_cli
from reconciler.storage.engines import UNLIMITED_TIMEOUTS, create_engine
from reconciler.storage.schema import upgrade

PEER_RETRY = Path(__file__).resolve().parent / "node" / "peer_retry.js"

FULL_JOBS = 10_000
SMOKE_JOBS = 300
EFFECTFUL = {"kinds": {"*": {"effect": "effectful"}}}
"""Every kind effectful: a job whose worker died mid-task is failed, not resumed."""


@dataclass(frozen=True)
class Servers:
    """Where one system's run lives: the reconciler's database and the system's own."""

    url: str
    """The reconciler's database (SQLAlchemy URL)."""
    conninfo: str
    """The same database for psycopg (key=value)."""
    stack: contextlib.ExitStack
    """Closes what a system starts beside the database (a redis-server)."""


class BulkSystem(Protocol):
    """One job system as this benchmark builds, checks and retries it."""

    name: str
    tool: str
    """The system's own bulk retry, as the report names it."""
    failed: str
    queued: str
    """Its failed and queued states, as it spells them."""

    def source(self) -> dict[str, Any]:
        """The config's ``[source]`` table for this system."""

    def build(self, jobs: int) -> None:
        """``jobs`` jobs whose workers died mid-task, in the system's own shape."""

    def count(self, state: str) -> int:
        """How many jobs are in ``state`` (the queued one: runnable now, on its queue)."""

    def settle(self) -> None:
        """Before each side: what a live system would have done since (a vacuum)."""

    def own_retry(self) -> float:
        """The system's own tool retrying every job still failed: its seconds, from its
        choosing of the jobs to its last write (its client already started)."""


class RqSystem:
    """RQ 2.x on a throwaway redis-server; its jobs over ``rq_jobs.QUEUES``."""

    name = "rq"
    tool = "rq requeue --all (per queue)"
    failed, queued = "failed", "queued"

    def __init__(self, servers: Servers) -> None:
        self._url = start_redis(servers.stack, "foreign_bulk")
        self._jobs: RqJobs | None = None

    def source(self) -> dict[str, Any]:
        return {"kind": "rq", "redis_url": self._url}

    def build(self, jobs: int) -> None:
        self._jobs = RqJobs(self._url, Size(jobs, jobs, jobs))
        self._jobs.build()
        self._jobs.kill()

    def count(self, state: str) -> int:
        jobs = self._built()
        counted = jobs.orphans_in(state)
        if state == self.queued:
            listed = sum(int(jobs.connection.llen(f"rq:queue:{name}")) for name in QUEUES)
            if listed != counted:
                raise RuntimeError(f"{counted} RQ jobs read queued, {listed} on the queues")
        return counted

    def settle(self) -> None:
        """Redis leaves nothing to settle."""

    def own_retry(self) -> float:
        from rq.cli.cli import main  # noqa: PLC0415 - optional, with rq

        with contextlib.redirect_stdout(io.StringIO()):
            started = time.perf_counter()
            for name in QUEUES:
                main(["requeue", "--all", "--queue", name, "--url", self._url],
                     standalone_mode=False)
            return time.perf_counter() - started

    def _built(self) -> RqJobs:
        if self._jobs is None:
            raise RuntimeError("the RQ jobs are not built yet")
        return self._jobs


class ProcrastinateSystem:
    """Procrastinate 3.x in schema ``procrastinate`` of the reconciler's database."""

    name = "procrastinate"
    tool = "JobManager.retry_job_by_id per job (the Django admin's Retry Job)"
    failed, queued = "failed", "todo"

    def __init__(self, servers: Servers) -> None:
        self._conninfo = servers.conninfo
        self._system = Procrastinate()

    def source(self) -> dict[str, Any]:
        return {"kind": "procrastinate", "schema": self._system.schema}

    def build(self, jobs: int) -> None:
        size = Size(jobs, jobs, jobs)
        self._system.build(self._conninfo, size)
        self._system.kill(self._conninfo, size)

    def count(self, state: str) -> int:
        runnable = " AND (scheduled_at IS NULL OR scheduled_at <= now())" \
            if state == self.queued else ""
        with psycopg.connect(self._conninfo) as conn:
            row = conn.execute(
                f"SELECT count(*) FROM {self._system.schema}.procrastinate_jobs "
                f"WHERE status = %s{runnable}", (state,)).fetchone()
        return 0 if row is None else int(row[0])

    def settle(self) -> None:
        schema = self._system.schema
        vacuum(self._conninfo, f"{schema}.procrastinate_jobs, {schema}.procrastinate_events")

    def own_retry(self) -> float:
        import procrastinate  # noqa: PLC0415 - optional
        from procrastinate import utils  # noqa: PLC0415

        options = f"{self._conninfo} options='-c search_path={self._system.schema}'"
        app = procrastinate.App(connector=procrastinate.SyncPsycopgConnector(
            conninfo=options))
        with app.open(), psycopg.connect(options) as conn:
            started = time.perf_counter()
            ids = [int(row[0]) for row in conn.execute(
                "SELECT id FROM procrastinate_jobs WHERE status = 'failed' ORDER BY id")]
            for job_id in ids:
                app.job_manager.retry_job_by_id(job_id, utils.utcnow())
            return time.perf_counter() - started


class PgBossSystem:
    """pg-boss 10 in schema ``pgboss`` of the reconciler's database; one queue,
    ``report``."""

    name = "pg-boss"
    tool = "boss.retry(queue, ids) of all N ids (Node)"
    failed, queued = "failed", "retry"

    def __init__(self, servers: Servers) -> None:
        self._conninfo = servers.conninfo
        self._system = PgBoss()

    def source(self) -> dict[str, Any]:
        return {"kind": "pg-boss"}

    def build(self, jobs: int) -> None:
        size = Size(jobs, jobs, jobs)
        self._system.build(self._conninfo, size)
        self._system.kill(self._conninfo, size)

    def count(self, state: str) -> int:
        runnable = " AND start_after <= now()" if state == self.queued else ""
        with psycopg.connect(self._conninfo) as conn:
            row = conn.execute(
                f"SELECT count(*) FROM {self._system.schema}.job "
                f"WHERE state = %s{runnable}", (state,)).fetchone()
        return 0 if row is None else int(row[0])

    def settle(self) -> None:
        vacuum(self._conninfo, f"{self._system.schema}.job")

    def own_retry(self) -> float:
        done = json.loads(_node(PEER_RETRY, self._conninfo, self._system.schema, "report"))
        if done["affected"] != done["requested"]:
            raise RuntimeError(f"pg-boss's retry changed {done['affected']} of "
                               f"{done['requested']} jobs")
        return float(done["ms"]) / 1000


SYSTEMS: dict[str, Callable[[Servers], BulkSystem]] = {
    "rq": RqSystem, "procrastinate": ProcrastinateSystem, "pg-boss": PgBossSystem}


@contextlib.contextmanager
def _servers() -> Iterator[tuple[Servers, Engine]]:
    """A throwaway PostgreSQL with one migrated database for the reconciler's tables."""
    from tests.pg_server import ThrowawayPostgres  # noqa: PLC0415 - the benchmark's server

    with ThrowawayPostgres() as server, contextlib.ExitStack() as stack:
        server.create_database("bench")
        url = server.url("bench")
        engine = create_engine(url, timeouts=UNLIMITED_TIMEOUTS)
        stack.callback(engine.dispose)
        upgrade(engine)
        yield Servers(url, f"{server.dsn} dbname=bench", stack), engine


def _expect(what: str, found: int, expected: int) -> None:
    if found != expected:
        raise RuntimeError(f"{what}: {found}, expected {expected}")


def measure(name: str, jobs: int, emit: Callable[[dict[str, Any]], None]) -> None:
    """Build 2N and fail them through passes; ours retries N, the system's tool the other
    N; each checked (see the module's docstring)."""
    with _servers() as (servers, engine):
        system = SYSTEMS[name](servers)
        system.build(2 * jobs)
        config = config_from({"source": system.source(), **EFFECTFUL, **NO_BRAKE},
                             database_url=servers.url, batch_size=BATCH_SIZE)
        with assemble_cli(config, engine=engine) as parts:
            pass_seconds, _ = _terminalize(parts, config.pass_config("bench"), 2 * jobs)
            _expect(f"{name} jobs failed by the passes", system.count(system.failed),
                    2 * jobs)
            desk = parts.desk
            if desk is None:
                raise RuntimeError(f"the {name} source has no operator desk")
            system.settle()
            seconds, sent, result = _bulk(engine, desk, OperatorAction.RETRY, jobs)
            _expect("our bulk retry applied", len(result["applied"]), jobs)
            _expect("our bulk retry recorded", _recorded(engine, desk.source,
                                                        OperatorAction.RETRY), jobs)
            _expect(f"{name} jobs queued after ours", system.count(system.queued), jobs)
            _expect(f"{name} jobs still failed after ours", system.count(system.failed), jobs)
            system.settle()
            peer_seconds = system.own_retry()
            _expect(f"{name} jobs queued after its own tool", system.count(system.queued),
                    2 * jobs)
    rate, peer_rate = jobs / seconds, jobs / peer_seconds
    emit({"source": name, "measurement": "bulk_retry", "value": round(rate),
          "unit": "jobs/s", "peer_value": round(peer_rate),
          "ratio_to_peer": round(rate / peer_rate, 3), "jobs": jobs,
          "seconds": round(seconds, 3), "peer_seconds": round(peer_seconds, 3),
          "statements_per_job": round(sent / jobs, 3),
          "terminalize": round(2 * jobs / pass_seconds), "peer_tool": system.tool})


def main(argv: list[str] | None = None) -> int:
    """Measure the chosen systems; a table, or one JSON object per line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.foreign_bulk",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=(*SYSTEMS, "all"), default="all")
    parser.add_argument("--jobs", type=int, default=FULL_JOBS,
                        help="N: jobs each side retries (2N are built)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE_JOBS} jobs: checks it runs, not how fast")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    jobs = SMOKE_JOBS if args.smoke else args.jobs
    if jobs < 1:
        parser.error("--jobs must be at least 1")
    emit = row_printer(args.json, 13)
    for name in SYSTEMS if args.source == "all" else (args.source,):
        measure(name, jobs, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
