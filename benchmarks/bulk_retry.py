"""The operator's bulk retry and bulk cancel of N jobs, beside the passes that decided them.

    python -m benchmarks.bulk_retry [--source native|table|all]
        [--engine sqlite|postgresql|mariadb|all] [--jobs N] [--smoke] [--json]

On a throwaway database of each engine (``--engine``, PostgreSQL 15 by default; SQLite in
a temporary file, PostgreSQL and MariaDB servers from tests/pg_server.py and
tests/mariadb_server.py), for each source, one database holds N jobs whose workers died
mid-step, each a claim with its lease expired:

- ``native``: this project's ``job_runs``, built in bulk as a claim leaves a job (the
  claim's generation, lease and attempt row, a one-step effectful plan whose step is
  ``started``);
- ``table``: a home-grown job table mapped column by column (the columns and the mapping
  of ``HomeGrownTable`` in benchmarks/foreign_systems.py, its ``[kinds."*"]`` effectful),
  every row claimed by a host whose lease ran out an hour ago, built by SQLAlchemy Core
  (``home_table``): in schema ``app`` on PostgreSQL, beside the reconciler's tables on
  SQLite and MariaDB.

Both run on every engine. In one run, on the same rows, one after the other:

- ``terminalize`` (the baseline, one per source and engine): the reconciler's real passes
  (``run_pass`` through the configured source, ``BATCH_SIZE`` a pass) until none is left;
  every job must end failed with a ``worker_died_mid_step`` decision recorded. Jobs per
  second.
- ``bulk_retry``: ``reconciler jobs retry --reason worker_died_mid_step --limit N --yes``
  as the command line runs it (``reconciler.cli.bulk.bulk_action`` through the desk that
  ``assemble_cli`` builds: the desk's ``bulk_targets``, then ``act_on_chunk`` a chunk of
  ``BULK_CHUNK`` jobs at a time; on both sources one transaction a chunk, its jobs read
  in one statement (locked where the engine locks rows), swapped in one ``UPDATE``
  fencing each job inside it, and recorded in one insert). Afterwards every job must be
  queued again and every retry recorded applied in ``operator_actions``.
- ``bulk_cancel``: ``reconciler jobs cancel --reason worker_died_mid_step --limit N --yes``
  on the jobs the retry just queued (a cancel acts on queued and running jobs, never on
  ended ones, and the bulk form picks jobs by their latest decision: these N still have
  the passes' ``worker_died_mid_step``). It is the incident's other half, the retried
  jobs taken back before a worker runs them. No pass cancels; it is measured against the
  same passes over the same N jobs as the retry, so that one baseline per source and
  engine sets both ratios. Queued jobs have no open attempt to close: a cancel of running
  jobs sends one more statement a chunk on the native source, not measured here.
  Afterwards every job must be cancelled (the table maps no cancelled status: failed,
  ``operator_cancel``) and every cancel recorded applied.

Each bulk row has its jobs per second, its ``ratio_to_pass``, the time choosing the jobs
took alone (``choosing_seconds``, timed before the action, which chooses again itself)
and the statements sent per job. Ratios, not absolute times, carry over between machines:
both sides run on the same rows of the same server in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from benchmarks.foreign_systems import HomeGrownTable
from benchmarks.harness import Databases, counting_statements, row_printer
from reconciler.cli.bulk import bulk_action
from reconciler.config.loader import config_from
from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.passes import PassConfig, run_pass
from reconciler.core.vocabulary import OperatorAction, Reason
from reconciler.root.cli import CliParts, assemble_cli
from reconciler.storage.clock import now_plus
from reconciler.storage.sql import attempts, steps
from reconciler.storage.sql import jobs as job_runs

ENGINES = ("sqlite", "postgresql", "mariadb")
BATCH_SIZE = 500
FULL_JOBS = 10_000
SMOKE_JOBS = 300
REASON = Reason.WORKER_DIED_MID_STEP.value
NOTE = "benchmark: the workers' host was replaced"
# Every job of the database dying at once is what the mass-staleness brake holds back for
# brake_hold_seconds (it looks like an outage); the baseline measures the passes' own rate,
# so the brake is off, as in benchmarks/recovery.py.
NO_BRAKE = {"brake_hold_seconds": 0.0}
PLAN = '[{"step_name": "publish", "effect_kind": "effectful"}]'
ACTIONS = (OperatorAction.RETRY, OperatorAction.CANCEL)
"""The bulk form's actions, in the order they run on the same jobs."""


@dataclass(frozen=True)
class Source:
    """One source as the benchmark builds and checks it."""

    name: str
    config: Callable[[str], dict[str, Any]]
    """The config file's content (``[source]``, ``[kinds]``) for an engine's dialect."""
    build: Callable[[Engine, int], None]
    """Fill the database (its engine, jobs) with the claims of dead workers."""
    status: Callable[[str], sa.ColumnElement[Any]]
    """The jobs' status column, for an engine's dialect."""
    failed: str
    """The status every job has after the passes, as the source spells it."""
    after: dict[OperatorAction, str]
    """The status every job has after each bulk action, as the source spells it."""


def _build_native(engine: Engine, jobs: int) -> None:
    """N claimed jobs whose worker died in their effectful step, as a claim leaves them,
    inserted in three statements of many rows (any engine)."""
    now = datetime.now(UTC)
    expired, quiet = now - timedelta(minutes=5), now - timedelta(minutes=10)
    ids = range(1, jobs + 1)
    with engine.begin() as conn:
        conn.execute(job_runs.insert(), [{
            "job_id": n, "job_kind": "report", "job_status": "processing",
            "step_plan": json.loads(PLAN), "resume_step_index": 0, "attempt_count": 1,
            "max_attempts": 3, "claim_generation": 1, "lease_token": f"bench-token-{n}",
            "lease_owner": "bench-worker", "lease_expires_at": expired, "claimed_at": quiet,
            "last_activity_at": quiet, "available_at": quiet, "operator_hold": False,
            "created_at": quiet, "updated_at": quiet} for n in ids])
        conn.execute(steps.insert(), [{
            "job_id": n, "step_index": 0, "step_name": "publish", "effect_kind": "effectful",
            "step_state": "started", "claim_generation": 1, "started_at": quiet}
            for n in ids])
        conn.execute(attempts.insert(), [{
            "job_id": n, "claim_generation": 1, "attempt_number": 1,
            "lease_owner": "bench-worker", "claimed_at": quiet} for n in ids])


def home_table(dialect: str) -> sa.Table:
    """``HomeGrownTable``'s ``jobs`` (the columns its mapping names, indexed on status), on
    any engine: in schema ``app`` on PostgreSQL as there, beside the reconciler's tables
    elsewhere (SQLite has no schemas; MariaDB's are databases)."""
    return sa.Table(
        "jobs", sa.MetaData(schema="app" if dialect == "postgresql" else None),
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("job_type", sa.String(100), nullable=False),
        sa.Column("status", sa.String(20), nullable=False, index=True),
        sa.Column("status_reason", sa.String(64)),
        sa.Column("lease_until", sa.DateTime(timezone=True)),
        sa.Column("claimed_by", sa.String(100)),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    )


def _build_table(engine: Engine, jobs: int) -> None:
    """The home-grown table with every row claimed by a host whose lease ran out an hour
    ago (by the database's clock), inserted in one statement of many rows."""
    table = home_table(engine.dialect.name)
    with engine.begin() as conn:
        if table.schema is not None:
            conn.execute(sa.schema.CreateSchema(table.schema))
        table.metadata.create_all(conn)
        conn.execute(table.insert().values(lease_until=now_plus(-3600.0)), [
            {"id": n, "job_type": "report", "status": "processing",
             "claimed_by": "host-dead", "attempts": 1} for n in range(1, jobs + 1)])


def _table_config(dialect: str) -> dict[str, Any]:
    """``HomeGrownTable``'s mapping, its jobs' one step effectful (a dead claim is a step
    whose effect may have happened, terminalized ``worker_died_mid_step``), its schema
    where ``home_table`` has one."""
    config = tomllib.loads(HomeGrownTable.source_toml)
    config["kinds"]["*"]["effect"] = "effectful"
    if home_table(dialect).schema is None:
        del config["source"]["schema"]
    return config


SOURCES = {
    "native": Source("native", lambda dialect: {}, _build_native,
                     lambda dialect: job_runs.c.job_status, "failed",
                     {OperatorAction.RETRY: "queued", OperatorAction.CANCEL: "cancelled"}),
    "table": Source("table", _table_config, _build_table,
                    lambda dialect: home_table(dialect).c.status, "failed",
                    {OperatorAction.RETRY: "pending", OperatorAction.CANCEL: "failed"}),
}


def _statuses(engine: Engine, status: sa.ColumnElement[Any]) -> dict[str, int]:
    """How many jobs each status holds."""
    with engine.connect() as conn:
        return {str(name): int(n) for name, n in conn.execute(
            sa.select(status, sa.func.count()).group_by(status))}


def _terminalize(parts: CliParts, pass_config: PassConfig, jobs: int) -> tuple[float, int]:
    """Passes until one decides less than a batch: (seconds, passes). Every decision
    must be a ``worker_died_mid_step`` terminalization."""
    passes = decided = 0
    started = time.perf_counter()
    while True:
        report = run_pass(parts.passes, pass_config)
        passes += 1
        decided += len(report.decisions)
        wrong = [d for d in report.decisions if d.reason.value != REASON]
        if wrong:
            raise RuntimeError(f"a pass decided {wrong[0].reason.value}, not {REASON}")
        if len(report.decisions) < pass_config.batch_size:
            seconds = time.perf_counter() - started
            break
    if decided != jobs:
        raise RuntimeError(f"the passes terminalized {decided} of {jobs} jobs")
    return seconds, passes


def _bulk_args(jobs: int) -> argparse.Namespace:
    """What ``reconciler jobs retry|cancel --reason worker_died_mid_step --limit N --yes
    --note ... --json`` parses to, for ``bulk_action``."""
    return argparse.Namespace(reason=REASON, disposition=None, kind=None, since=None,
                              limit=jobs,
                              dry_run=False, yes=True, note=NOTE, json=True)


@contextlib.contextmanager
def _silenced() -> Iterator[io.StringIO]:
    """The command's lines and JSON kept off the benchmark's output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        yield out


def _timed_targets(desk: OperatorDesk, action: OperatorAction, jobs: int
                   ) -> tuple[float, int]:
    """How long choosing the jobs takes alone (the bulk form's first step): (seconds,
    jobs chosen). Read-only; the timed bulk action chooses them again itself."""
    started = time.perf_counter()
    targets = desk.bulk_targets(action, reason=REASON, kind=None, since=None, limit=jobs)
    return time.perf_counter() - started, len(targets)


def _bulk(engine: Engine, desk: OperatorDesk, action: OperatorAction, jobs: int
          ) -> tuple[float, int, dict[str, Any]]:
    """The bulk action as the command line runs it: (seconds, statements sent, its JSON)."""
    with counting_statements(engine) as sent, _silenced() as out:
        started = time.perf_counter()
        code = bulk_action(_bulk_args(jobs), desk, action, "bench")
        seconds = time.perf_counter() - started
    result: dict[str, Any] = json.loads(out.getvalue())
    if code != 0 or result["refused"]:
        raise RuntimeError(f"the bulk {action} refused {len(result['refused'])} jobs "
                           f"(exit {code}): {result['refused'][:3]}")
    return seconds, len(sent), result


def _recorded(engine: Engine, source: str, action: OperatorAction) -> int:
    """How many applied actions of ``action`` ``operator_actions`` holds for ``source``."""
    with engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT count(*) FROM operator_actions WHERE job_source = :source "
            "AND operator_action = :action AND action_outcome = 'applied'"),
            {"source": source, "action": action.value}).scalar_one())


def measure(source: Source, jobs: int, databases: Databases,
            emit: Callable[[dict[str, Any]], None]) -> None:
    """Build, terminalize through real passes (timed: the baseline), then each bulk action
    (timed), each checked: every job in the status it leaves, every action recorded."""
    rows: list[dict[str, Any]] = []
    with databases.fresh() as engine:
        url = engine.url.render_as_string(hide_password=False)
        dialect = engine.dialect.name
        status = source.status(dialect)
        source.build(engine, jobs)
        config = config_from({**source.config(dialect), **NO_BRAKE}, database_url=url,
                             batch_size=BATCH_SIZE)
        with assemble_cli(config, engine=engine) as parts:
            pass_seconds, passes = _terminalize(parts, config.pass_config("bench"), jobs)
            after_pass = _statuses(engine, status)
            if after_pass.get(source.failed) != jobs:
                raise RuntimeError(f"after the passes: {after_pass}, not {jobs} failed")
            desk = parts.desk
            if desk is None:
                raise RuntimeError(f"the {source.name} source has no operator desk")
            pass_rate = jobs / pass_seconds
            for action in ACTIONS:
                choosing, chosen = _timed_targets(desk, action, jobs)
                if chosen != jobs:
                    raise RuntimeError(f"the bulk {action} chose {chosen} of {jobs} jobs")
                seconds, sent, result = _bulk(engine, desk, action, jobs)
                after = _statuses(engine, status).get(source.after[action], 0)
                recorded = _recorded(engine, desk.source, action)
                if len(result["applied"]) != jobs or after != jobs or recorded != jobs:
                    raise RuntimeError(
                        f"after the bulk {action}: {len(result['applied'])} applied, "
                        f"{after} {source.after[action]}, {recorded} recorded; expected "
                        f"{jobs} each")
                rate = jobs / seconds
                rows.append({"measurement": f"bulk_{action}", "value": round(rate),
                             "unit": "jobs/s", "seconds": round(seconds, 3),
                             "ratio_to_pass": round(rate / pass_rate, 3),
                             "choosing_seconds": round(choosing, 3),
                             "statements_per_job": round(sent / jobs, 2),
                             "recorded": recorded, f"{source.after[action]}_after": after})
    base = {"source": source.name, "engine": databases.engine_name, "jobs": jobs}
    emit({**base, "measurement": "terminalize", "value": round(pass_rate), "unit": "jobs/s",
          "seconds": round(pass_seconds, 3), "passes": passes, "batch_size": BATCH_SIZE})
    for row in rows:
        emit({**base, **row})


def main(argv: list[str] | None = None) -> int:
    """Measure the chosen sources; a table, or one JSON object per line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bulk_retry",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=(*SOURCES, "all"), default="all")
    parser.add_argument("--engine", choices=(*ENGINES, "all"), default="postgresql",
                        help="where the jobs live")
    parser.add_argument("--jobs", type=int, default=FULL_JOBS)
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE_JOBS} jobs: checks it runs, not how fast")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    jobs = SMOKE_JOBS if args.smoke else args.jobs
    if jobs < 1:
        parser.error("--jobs must be at least 1")

    emit = row_printer(args.json, 8)

    for engine_name in ENGINES if args.engine == "all" else (args.engine,):
        databases = Databases(engine_name, None)
        try:
            for name in SOURCES if args.source == "all" else (args.source,):
                measure(SOURCES[name], jobs, databases, emit)
        finally:
            databases.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
