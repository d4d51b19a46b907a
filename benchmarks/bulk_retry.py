"""The operator's bulk retry of N terminalized jobs, beside the pass that terminalized them.

    python -m benchmarks.bulk_retry [--source native|table|all]
        [--engine sqlite|postgresql|mariadb|all] [--jobs N] [--smoke] [--json]

On a throwaway database of each engine (``--engine``, PostgreSQL 15 by default; SQLite in
a temporary file, PostgreSQL and MariaDB servers from tests/pg_server.py and
tests/mariadb_server.py), for each source, one database holds N jobs whose workers died
mid-step, each a claim with its lease expired five minutes ago:

- ``native``: this project's ``job_runs``, built in bulk as a claim leaves a job (the
  claim's generation, lease and attempt row, a one-step effectful plan whose step is
  ``started``), on every engine;
- ``table``: the mapped table of benchmarks/foreign_systems.py (``HomeGrownTable``, every
  row claimed by a dead host), its ``[kinds."*"]`` effectful; on PostgreSQL only (the
  table's builder is PostgreSQL's).

In one run:

- ``terminalize`` (the baseline): the reconciler's real passes (``run_pass`` through the
  configured source, ``BATCH_SIZE`` a pass) until none is left; every job must end failed
  with a ``worker_died_mid_step`` decision recorded. Jobs per second.
- ``bulk_retry``: ``reconciler jobs retry --reason worker_died_mid_step --limit N --yes``
  as the command line runs it (``reconciler.cli.bulk.bulk_action``: the desk's
  ``bulk_targets``, then ``act`` per job, each fenced and recorded on its own), through
  the desk the command line assembles (``assemble_cli``). Jobs per second, its
  ``ratio_to_pass``, the time choosing the jobs took apart, and the statements sent per
  job. Afterwards every job must be queued again and every retry recorded applied in
  ``operator_actions``.

Ratios, not absolute times, carry over between machines: both sides run on the same rows
of the same server, one after the other.
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

from benchmarks.foreign_base import Size
from benchmarks.foreign_systems import HomeGrownTable
from benchmarks.harness import Databases, counting_statements, row_printer
from reconciler.cli.bulk import bulk_action
from reconciler.config.loader import config_from
from reconciler.core.operator_desk import OperatorDesk
from reconciler.core.passes import PassConfig, run_pass
from reconciler.core.vocabulary import OperatorAction, Reason
from reconciler.root.cli import CliParts, assemble_cli
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


@dataclass(frozen=True)
class Source:
    """One source as the benchmark builds and checks it."""

    name: str
    config: dict[str, Any]
    """The config file's content (``[source]``, ``[kinds]``)."""
    build: Callable[[Engine, int], None]
    """Fill the database (its engine, jobs) with the claims of dead workers."""
    engines: tuple[str, ...]
    """The engines its builder runs on."""
    count: str
    """A query of one number per status: ``SELECT status, count(*) ... GROUP BY``."""
    failed: str
    queued: str
    """The statuses a terminalized and a retried job have, as the source spells them."""


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


def _build_table(engine: Engine, jobs: int) -> None:
    """The home-grown table with every row claimed by a host that died an hour ago."""
    url = engine.url
    conninfo = (f"host={url.host} port={url.port} user={url.username} "
                f"dbname={url.database}")
    system = HomeGrownTable()
    size = Size(jobs=jobs, running=jobs, orphans=jobs)
    system.build(conninfo, size)
    system.kill(conninfo, size)


def _table_config() -> dict[str, Any]:
    """``HomeGrownTable``'s mapping, its jobs' one step effectful: a dead claim is a step
    whose effect may have happened, terminalized ``worker_died_mid_step``."""
    config = tomllib.loads(HomeGrownTable.source_toml)
    config["kinds"]["*"]["effect"] = "effectful"
    return config


SOURCES = {
    "native": Source("native", {}, _build_native, ENGINES,
                     "SELECT job_status, count(*) FROM job_runs GROUP BY job_status",
                     failed="failed", queued="queued"),
    "table": Source("table", _table_config(), _build_table, ("postgresql",),
                    "SELECT status, count(*) FROM app.jobs GROUP BY status",
                    failed="failed", queued="pending"),
}


def _statuses(engine: Engine, query: str) -> dict[str, int]:
    with engine.connect() as conn:
        return {str(status): int(n) for status, n in conn.execute(sa.text(query))}


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
    """What ``reconciler jobs retry --reason worker_died_mid_step --limit N --yes
    --note ... --json`` parses to, for ``bulk_action``."""
    return argparse.Namespace(reason=REASON, kind=None, since=None, limit=jobs,
                              dry_run=False, yes=True, note=NOTE, json=True)


@contextlib.contextmanager
def _silenced() -> Iterator[io.StringIO]:
    """The command's lines (one per job) and JSON kept off the benchmark's output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        yield out


def _timed_targets(desk: OperatorDesk, jobs: int) -> tuple[float, int]:
    """How long choosing the jobs takes alone (the bulk form's first step): (seconds,
    jobs chosen). Read-only; the timed bulk retry chooses them again itself."""
    started = time.perf_counter()
    targets = desk.bulk_targets(OperatorAction.RETRY, reason=REASON, kind=None, since=None,
                                limit=jobs)
    return time.perf_counter() - started, len(targets)


def _retry(engine: Engine, desk: OperatorDesk, jobs: int) -> tuple[float, int, dict[str, Any]]:
    """The bulk retry as the command line runs it: (seconds, statements sent, its JSON)."""
    with counting_statements(engine) as sent, _silenced() as out:
        started = time.perf_counter()
        code = bulk_action(_bulk_args(jobs), desk, OperatorAction.RETRY, "bench")
        seconds = time.perf_counter() - started
    result: dict[str, Any] = json.loads(out.getvalue())
    if code != 0 or result["refused"]:
        raise RuntimeError(f"the bulk retry refused {len(result['refused'])} jobs "
                           f"(exit {code}): {result['refused'][:3]}")
    return seconds, len(sent), result


def _recorded(engine: Engine, source: str) -> int:
    """The applied retries ``operator_actions`` holds for ``source``."""
    with engine.connect() as conn:
        return int(conn.execute(sa.text(
            "SELECT count(*) FROM operator_actions WHERE job_source = :source "
            "AND operator_action = 'retry' AND action_outcome = 'applied'"),
            {"source": source}).scalar_one())


def measure(source: Source, jobs: int, databases: Databases,
            emit: Callable[[dict[str, Any]], None]) -> None:
    """Build, terminalize through real passes (timed: the baseline), bulk-retry (timed),
    and check every job queued again and every retry recorded."""
    with databases.fresh() as engine:
        url = engine.url.render_as_string(hide_password=False)
        source.build(engine, jobs)
        config = config_from({**source.config, **NO_BRAKE}, database_url=url,
                             batch_size=BATCH_SIZE)
        with assemble_cli(config, engine=engine) as parts:
            pass_seconds, passes = _terminalize(parts, config.pass_config("bench"), jobs)
            after_pass = _statuses(engine, source.count)
            if after_pass.get(source.failed) != jobs:
                raise RuntimeError(f"after the passes: {after_pass}, not {jobs} failed")
            if parts.desk is None:
                raise RuntimeError(f"the {source.name} source has no operator desk")
            targets_seconds, chosen = _timed_targets(parts.desk, jobs)
            if chosen != jobs:
                raise RuntimeError(f"the bulk form chose {chosen} of {jobs} jobs")
            seconds, sent, result = _retry(engine, parts.desk, jobs)
        after_retry = _statuses(engine, source.count)
        recorded = _recorded(engine, parts.desk.source)
        if len(result["applied"]) != jobs or after_retry.get(source.queued) != jobs \
                or recorded != jobs:
            raise RuntimeError(f"after the bulk retry: {len(result['applied'])} applied, "
                               f"statuses {after_retry}, {recorded} recorded; "
                               f"expected {jobs} each")
    pass_rate, retry_rate = jobs / pass_seconds, jobs / seconds
    base = {"source": source.name, "engine": databases.engine_name, "jobs": jobs}
    emit({**base, "measurement": "terminalize", "value": round(pass_rate), "unit": "jobs/s",
          "seconds": round(pass_seconds, 3), "passes": passes, "batch_size": BATCH_SIZE})
    emit({**base, "measurement": "bulk_retry", "value": round(retry_rate), "unit": "jobs/s",
          "seconds": round(seconds, 3), "ratio_to_pass": round(retry_rate / pass_rate, 3),
          "choosing_seconds": round(targets_seconds, 3),
          "statements_per_job": round(sent / jobs, 2), "recorded": recorded,
          "queued_after": after_retry.get(source.queued, 0)})


def main(argv: list[str] | None = None) -> int:
    """Measure the chosen sources; a table, or one JSON object per line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bulk_retry",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=(*SOURCES, "all"), default="all")
    parser.add_argument("--engine", choices=(*ENGINES, "all"), default="postgresql",
                        help="where the jobs live (a source runs on the engines its "
                             "builder supports)")
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
                if engine_name in SOURCES[name].engines:
                    measure(SOURCES[name], jobs, databases, emit)
        finally:
            databases.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
