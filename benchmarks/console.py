"""The operator console's pages against a large audit: their cost follows the page, not the
table.

    python -m benchmarks.console --engine sqlite|postgresql [--decisions N] [--smoke]

One database of 100,000 jobs and an audit of N decisions (default 1,000,000) spread over
30 days in passes of 200, every reason represented, then 100 quiet passes. Served by the
sidecar's own HTTP server (``reconciler run``'s, console on), each page is requested
``REQUESTS`` times and its median and fastest answer times reported:

- ``/``: brake and shadow state, the last passes folded, the 24-hour chart, the latest
  decisions;
- ``/decisions?reason=worker_died_mid_step&since=1h``: the operator's question;
- ``/decisions?disposition=terminalize&kind=report*``: a kind glob through the job rows;
- ``/decisions?before=<the middle id>``: a page half-way down the audit;
- ``/jobs/native/<id>``: one job's page.

The baseline, measured in the same run: the same pages over an audit of ``BASELINE``
decisions (built first, then grown to N in place), and ``/healthz`` (the server's floor).
The ratio of each page at N to itself at the baseline says whether cost follows the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from benchmarks.__main__ import Databases
from benchmarks.dataset import Shape, analyze, build
from reconciler.core.vocabulary import Reason
from reconciler.storage.engines import is_postgresql

JOBS = 100_000
BASELINE = 10_000
PER_PASS = 200
DAYS = 30
REQUESTS = 30
SMOKE_DECISIONS = 20_000
REASONS = tuple(r.value for r in Reason)
_TERMINAL = {"worker_wedged", "unresumable_plan", "completion_recovered",
             "completion_unrecorded", "step_failed", "worker_died_mid_step", "crash_loop",
             "resume_exhausted"}
_RESUMED = {"resumed_idempotent_step", "resumed_from_unstarted_step"}


def _series(engine: Engine, first: int, last: int) -> str:
    if is_postgresql(engine):
        return f"generate_series({first}, {last}) AS s(n)"
    return (f"(WITH RECURSIVE seq(n) AS (SELECT {first} UNION ALL SELECT n + 1 FROM seq "
            f"WHERE n < {last}) SELECT n FROM seq) AS s")


def _time(engine: Engine, seconds_ago: str) -> str:
    if is_postgresql(engine):
        return f"(statement_timestamp() - make_interval(secs => {seconds_ago}))"
    return (f"(strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || ({seconds_ago}) || ' seconds') "
            "|| '000')")


def _case(column: str, values: tuple[str, ...]) -> str:
    whens = " ".join(f"WHEN {i} THEN '{v}'" for i, v in enumerate(values))
    return f"CASE {column} % {len(values)} {whens} END"


def _disposition(reason_sql: str) -> str:
    terminal = ", ".join(f"'{r}'" for r in _TERMINAL)
    resumed = ", ".join(f"'{r}'" for r in _RESUMED)
    return (f"CASE WHEN {reason_sql} IN ({terminal}) THEN 'terminalize' "
            f"WHEN {reason_sql} IN ({resumed}) THEN 'resume' ELSE 'skip' END")


def grow_audit(engine: Engine, first: int, last: int, total: int) -> None:
    """Decisions ``first``..``last`` of ``total``, oldest first over ``DAYS`` days: decision
    n is in pass n // PER_PASS + 1, decided (total - n) * DAYS days / total ago."""
    span = DAYS * 86400.0 / total
    first_pass, last_pass = (first - 1) // PER_PASS + 1, (last - 1) // PER_PASS + 1
    reason = _case("n", REASONS)
    with engine.begin() as conn:
        ago = f"({total} - n * {PER_PASS}) * {span}"
        conn.execute(sa.text(f"""
            INSERT INTO reconciliation_passes (pass_id, reconciler_instance, started_at,
                finished_at, candidates_seen, resumed_count, terminalized_count,
                skipped_count, pass_outcome)
            SELECT n, 'bench', {_time(engine, ago)}, {_time(engine, ago)}, {PER_PASS},
                0, 0, 0, 'ok' FROM {_series(engine, first_pass, last_pass)}"""))
        ago = f"({total} - n) * {span}"
        evidence = ('{"attempts_used": 1, "max_attempts": 3, "lease_live": false, '
                    '"step_states": ["succeeded", "started"], "plan_length": 2}')
        conn.execute(sa.text(f"""
            INSERT INTO reconciliation_decisions (decision_id, pass_id, job_source, job_id,
                decided_at, disposition, decision_reason, generation_before,
                generation_after, resume_step_index, decision_evidence, shadow_mode)
            SELECT n, (n - 1) / {PER_PASS} + 1, 'native', CAST(n % {JOBS} + 1 AS TEXT),
                {_time(engine, ago)}, {_disposition(reason)}, {reason}, 1, NULL, NULL,
                '{evidence}', false
            FROM {_series(engine, first, last)}"""))
    analyze(engine)


def quiet_passes(engine: Engine, after_pass: int, count: int) -> None:
    """``count`` quiet passes after the last one: what a calm fleet's audit ends with."""
    with engine.begin() as conn:
        conn.execute(sa.text(f"""
            INSERT INTO reconciliation_passes (pass_id, reconciler_instance, started_at,
                finished_at, pass_outcome)
            SELECT n, 'bench', {_time(engine, "0")}, {_time(engine, "0")}, 'ok'
            FROM {_series(engine, after_pass + 1, after_pass + count)}"""))
        if is_postgresql(engine):
            for table, column in (("reconciliation_passes", "pass_id"),
                                  ("reconciliation_decisions", "decision_id")):
                conn.execute(sa.text(f"SELECT setval(pg_get_serial_sequence('{table}', "
                                     f"'{column}'), (SELECT max({column}) FROM {table}))"))


def timed_ms(url: str) -> tuple[float, float]:
    """The median and the fastest of ``REQUESTS`` answers (after one untimed warm-up): on
    a shared machine the median carries the neighbours' load, the fastest the page's own
    cost."""
    def get() -> None:
        with urllib.request.urlopen(url, timeout=60) as answer:  # noqa: S310 - our server
            assert answer.status == 200, url
            answer.read()

    get()
    samples = []
    for _ in range(REQUESTS):
        started = time.perf_counter()
        get()
        samples.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(samples), 2), round(min(samples), 2)


def pages(decisions: int, total: int) -> dict[str, str]:
    """The measured paths for an audit holding the newest ``decisions`` of ``total``."""
    return {"overview": "/", "died_mid_step_last_hour":
            "/decisions?reason=worker_died_mid_step&since=1h",
            "terminalized_kind_glob": "/decisions?disposition=terminalize&kind=report*",
            "half_way_down": f"/decisions?before={total - decisions // 2}",
            "job": "/jobs/native/4242", "healthz": "/healthz"}


def _served(url: str) -> AbstractContextManager[str]:
    from tests.console_support import served  # noqa: PLC0415 - the tests' own server set-up

    return served(url)


def measure(engine: Engine, url: str, decisions: int,
            emit: Callable[[dict[str, Any]], None]) -> None:
    """Build the baseline audit, time the pages, grow it to ``decisions``, time again."""
    build(engine, Shape(jobs=JOBS, stale=0))
    # The newest BASELINE decisions first (the last hours hold the same rows at either
    # size), then the older ones below them: the audit grows backwards in time.
    for size in (BASELINE, decisions):
        if size == BASELINE:
            grow_audit(engine, decisions - BASELINE + 1, decisions, decisions)
            quiet_passes(engine, (decisions - 1) // PER_PASS + 1, 100)
        else:
            grow_audit(engine, 1, decisions - BASELINE, decisions)
        with _served(url) as base:
            for name, path in pages(size, decisions).items():
                median, fastest = timed_ms(base + path)
                emit({"page": name, "decisions": size, "ms": median, "fastest_ms": fastest})


def main(argv: list[str] | None = None) -> int:
    """Run on one engine and print a JSON line per page and size, then the ratios."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.console")
    parser.add_argument("--engine", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--decisions", type=int, default=1_000_000)
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE_DECISIONS} decisions: checks it runs, not how fast")
    parser.add_argument("--database-url", help="an empty PostgreSQL database to use")
    args = parser.parse_args(argv)
    decisions = SMOKE_DECISIONS if args.smoke else max(args.decisions, BASELINE * 2)
    results: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        row = {"engine": args.engine, **row}
        results.append(row)
        print(json.dumps(row), flush=True)

    dbs = Databases(args.engine, args.database_url)
    try:
        with dbs.fresh() as engine:
            measure(engine, engine.url.render_as_string(hide_password=False), decisions, emit)
    finally:
        dbs.close()
    at = {(r["page"], r["decisions"]): (r["ms"], r["fastest_ms"]) for r in results}
    print(f"{'engine':<10} {'page':<24} median (fastest) ms at {BASELINE:,} and at "
          f"{decisions:,}; ratio of medians")
    for name in pages(decisions, decisions):
        (small, small_best), (large, large_best) = at[name, BASELINE], at[name, decisions]
        print(f"{args.engine:<10} {name:<24} {small:>7.2f} ({small_best:>6.2f})  "
              f"{large:>7.2f} ({large_best:>6.2f})  {large / max(small, 0.01):>5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
