"""Benchmarks of the reconciliation pass, each beside a baseline measured in the same run.

    python -m benchmarks --engine sqlite --jobs 1000000 --stale 10000
    python -m benchmarks --engine postgresql --jobs 1000000 --stale 10000 [--peers]
    python -m benchmarks --engine mariadb --jobs 1000000   # MariaDB beside PostgreSQL
    python -m benchmarks --engine all       # SQLite, PostgreSQL and MariaDB in one run
    python -m benchmarks --smoke            # N = 10k on both engines, checks it runs
    python -m benchmarks --engine mariadb --smoke   # the same on MariaDB and PostgreSQL
    # every run also counts the job table's reads in a recovering and a quiet pass
    python -m benchmarks --measure time_to_recovery [--smoke]   # benchmarks/recovery.py
    python -m benchmarks --measure parked [--smoke]   # held and gated jobs: benchmarks/parked.py
    python -m benchmarks --source procrastinate|graphile-worker|pg-boss|table|django-tasks|
                                  celery|all [--smoke]
        # a foreign source at a million rows beside its system's own sweep:
        # benchmarks/foreign.py (--source native, the default: everything above)
    python -m benchmarks --source rq [--engine sqlite|postgresql|both] [--smoke]
        # RQ at 100k jobs in Redis beside its StartedJobRegistry.cleanup:
        # benchmarks/foreign_rq.py (not in "all": it needs rq and redis-server)
    python -m benchmarks --source dramatiq [--engine sqlite|postgresql|both] [--smoke]
        # Dramatiq at 100k messages in Redis beside its own maintenance:
        # benchmarks/foreign_dramatiq.py (not in "all": it needs dramatiq and redis-server)

PostgreSQL and MariaDB: ``--database-url`` names an empty database of its engine to use,
else a throwaway server is started (tests/pg_server.py, tests/mariadb_server.py; Debian's
postgresql and mariadb-server binaries).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.engine import Engine

from benchmarks import foreign, foreign_dramatiq, foreign_rq, parked
from benchmarks.dataset import Shape, build, floor_update, restore_stale, writes_floor
from benchmarks.foreign_python import SYSTEMS
from benchmarks.harness import (
    BATCH_SIZES,
    PROGRESS,
    QUIET_PASSES,
    Databases,
    Measurement,
    bench_config,
    counting_statements,
    drain,
    job_table_reads,
    store_on,
    timed,
)
from benchmarks.recovery import plan_for, run_recovery
from reconciler.core.brake import BrakeLimits
from reconciler.core.passes import run_pass

JOB_TABLE = "job_runs"
"""The native source's job table."""
COUNTING_BRAKE = BrakeLimits(min_jobs=10**9, stale_fraction=1.0, hold_seconds=120.0)
"""A brake that counts on every pass that changes something, as the service's does, and
never engages (no fleet reaches ``min_jobs``)."""


def measure_recovery(dbs: Databases, shape: Shape, batch_size: int) -> list[Measurement]:
    """Recovered jobs per second over all S stale jobs, beside the set-based floor."""
    with dbs.fresh() as engine:
        _build(engine, shape)
        PROGRESS.phase(f"{dbs.engine_name}: recovery baselines (set-based UPDATEs)")
        floor_seconds, floor_rows = timed(lambda: floor_update(engine))
        restore_stale(engine, shape)
        writes_cpu = time.process_time()
        writes_seconds, writes_rows = timed(lambda: writes_floor(engine))
        writes_cpu = time.process_time() - writes_cpu
        restore_stale(engine, shape)
        store = store_on(engine)
        PROGRESS.phase(f"{dbs.engine_name}: recovery, draining {shape.stale} stale jobs")
        cpu = time.process_time()
        seconds, (decided, passes) = timed(lambda: drain(store, batch_size,
                                                          stale=shape.stale))
        cpu = time.process_time() - cpu
    rate, floor_rate = decided / seconds, floor_rows / floor_seconds
    writes_rate = writes_rows / writes_seconds
    extra = {"floor_value": round(floor_rate), "ratio_to_floor": round(rate / floor_rate, 3),
             "writes_floor_value": round(writes_rate),
             "ratio_to_writes_floor": round(rate / writes_rate, 3),
             "batch_size": batch_size, "passes": passes, "seconds": round(seconds, 3)}
    if dbs.engine_name == "sqlite" and cpu > 0 and writes_cpu > 0:
        # SQLite works in this process: the same ratio in CPU time holds on a loaded
        # machine, where wall time moves with the other processes.
        extra["cpu_ratio_to_writes_floor"] = round(
            (decided / cpu) / (writes_rows / writes_cpu), 3)
    return [Measurement("recovery", dbs.engine_name, shape.jobs, shape.stale, round(rate),
                        "jobs/s", extra)]


def quiet_pass_ms(engine: Engine) -> float:
    """Median wall time of a full pass (lease, pass record, scans) with nothing stale."""
    store = store_on(engine)
    config = bench_config(500)
    run_pass(store, config)
    samples = []
    PROGRESS.phase(f"{QUIET_PASSES} quiet passes", total=QUIET_PASSES, announce=False)
    for n in range(QUIET_PASSES):
        PROGRESS.advance(n)
        seconds, report = timed(lambda: run_pass(store, config))
        if report.decisions:
            raise RuntimeError("the quiet-pass measurement found stale jobs")
        samples.append(seconds * 1000)
    return statistics.median(samples)


def measure_quiet(dbs: Databases, jobs: int) -> Measurement:
    """A pass with nothing stale over ``jobs`` jobs, 1% of them live and running."""
    with dbs.fresh() as engine:
        _build(engine, Shape(jobs=jobs, stale=0))
        PROGRESS.phase(f"{dbs.engine_name}: a pass with nothing stale over {jobs} jobs")
        return Measurement("quiet_pass", dbs.engine_name, jobs, 0,
                           round(quiet_pass_ms(engine), 3), "ms",
                           {"live_running": Shape(jobs, 0).live, "samples": QUIET_PASSES})


def measure_reads(dbs: Databases) -> Measurement:
    """The job table's reads in a recovering pass (a full batch, the brake counting) and in
    a quiet one: statements whose FROM or JOIN names it."""
    shape = Shape(jobs=10_000, stale=1_000)
    config = dataclasses.replace(bench_config(500), brake=COUNTING_BRAKE)
    with dbs.fresh() as engine:
        _build(engine, shape)
        PROGRESS.phase(f"{dbs.engine_name}: the job table's reads per pass")
        store = store_on(engine)
        with counting_statements(engine) as sent:
            recovering = run_pass(store, config)
        reads = job_table_reads(sent, JOB_TABLE)
        while len(run_pass(store, config).decisions) == config.batch_size:
            pass
        with counting_statements(engine) as sent:
            quiet = run_pass(store, config)
    if len(recovering.decisions) != config.batch_size or quiet.decisions:
        raise RuntimeError("the reads were not counted on a full and on a quiet pass")
    return Measurement("job_table_reads", dbs.engine_name, shape.jobs, shape.stale, reads,
                       "statements", {"quiet": job_table_reads(sent, JOB_TABLE),
                                      "batch_size": config.batch_size})


def measure_round_trips(dbs: Databases) -> list[Measurement]:
    """Statements one pass issues, per batch size: they must not grow with the batch."""
    out = []
    for batch_size in BATCH_SIZES:
        shape = Shape(jobs=max(10_000, batch_size * 3), stale=batch_size * 2)
        with dbs.fresh() as engine:
            _build(engine, shape)
            PROGRESS.phase(f"{dbs.engine_name}: statements of a pass of {batch_size}")
            with counting_statements(engine) as statements:
                report = run_pass(store_on(engine), bench_config(batch_size))
        out.append(Measurement("round_trips_per_batch", dbs.engine_name, shape.jobs,
                               shape.stale, len(statements), "statements",
                               {"batch_size": batch_size, "decided": len(report.decisions)}))
    return out


MEMORY_PROBE = """
import json, resource, sys, tracemalloc
from reconciler.storage.engines import create_engine
from reconciler.storage.sql_store import SqlStore
from benchmarks.harness import drain
from tests.progress import Progress
engine = create_engine(sys.argv[1])
store = SqlStore(engine)
tracemalloc.start()
with Progress("benchmark memory probe", enabled=sys.argv[4] == "1") as progress:
    decided, passes = drain(store, int(sys.argv[2]), progress, int(sys.argv[3]))
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"decided": decided, "peak_python_bytes": peak,
                  "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def measure_memory(dbs: Databases, stale_counts: tuple[int, ...]) -> list[Measurement]:
    """Peak memory of a process that drains S stale jobs, for each S."""
    out = []
    for stale in stale_counts:
        shape = Shape(jobs=max(stale * 2, 10_000), stale=stale)
        with dbs.fresh() as engine:
            _build(engine, shape)
            PROGRESS.phase(f"{dbs.engine_name}: peak memory of a process draining {stale}")
            url = engine.url.render_as_string(hide_password=False)
            # stderr is left to the terminal: the probe's own progress lines.
            probe = subprocess.run(
                [sys.executable, "-c", MEMORY_PROBE, url, "500", str(stale),
                 "1" if PROGRESS.enabled else "0"], stdout=subprocess.PIPE,
                text=True, check=True, cwd=Path(__file__).resolve().parent.parent,
            )
        result = json.loads(probe.stdout)
        out.append(Measurement("peak_memory", dbs.engine_name, shape.jobs, stale,
                               round(result["peak_python_bytes"] / 1024 / 1024, 2), "MiB",
                               {"max_rss_mib": round(result["max_rss_kib"] / 1024, 1),
                                "decided": result["decided"]}))
    return out


def _build(engine: Engine, shape: Shape) -> None:
    PROGRESS.phase(f"building a dataset of {shape.jobs} jobs ({shape.stale} stale)")
    build(engine, shape)


def run(engine_name: str, base_url: str | None, jobs: int, stale: int, *,
        memory: tuple[int, ...], peers: bool, emit: Callable[[Measurement], None]) -> None:
    """Every measurement for one engine, printed as it is made."""
    dbs = Databases(engine_name, base_url)
    try:
        for m in measure_recovery(dbs, Shape(jobs, stale), 500):
            emit(m)
        for size in sorted({min(10_000, jobs), jobs}):
            emit(measure_quiet(dbs, size))
        emit(measure_reads(dbs))
        for m in measure_round_trips(dbs):
            emit(m)
        for m in measure_memory(dbs, memory):
            emit(m)
        if peers:
            from benchmarks.peers import measure_procrastinate  # noqa: PLC0415 - optional

            for m in measure_procrastinate(dbs, Shape(jobs, stale)):
                emit(m)
    finally:
        dbs.close()


def measure_parked(engine_name: str, base_url: str | None, jobs: int, count: int
                   ) -> Measurement:
    """The quiet pass with ``count`` held and gated jobs parked (benchmarks/parked.py)."""
    dbs = Databases(engine_name, base_url)
    try:
        with dbs.fresh() as engine:
            figures = parked.measure(engine, bench_config(parked.BATCH_SIZE), jobs, count)
    finally:
        dbs.close()
    return Measurement("quiet_pass_parked", engine_name, jobs, count,
                       figures.pop("parked_quiet_ms"), "ms", figures)


ENGINE_NAMES = ("sqlite", "postgresql", "mariadb")
ENGINE_RUNS = {"both": ("sqlite", "postgresql"), "mariadb": ("postgresql", "mariadb"),
               "all": ENGINE_NAMES}
"""``--engine`` values that run several engines. MariaDB's figures are read beside
PostgreSQL's measured in the same run, so ``mariadb`` runs both."""


def _named_url(database_url: str | None, engine_name: str) -> str | None:
    """``--database-url`` for the engine it names (by its scheme), else None."""
    if database_url is None or engine_name == "sqlite":
        return None
    scheme = "mysql" if engine_name == "mariadb" else "postgresql"
    return database_url if database_url.startswith(scheme) else None


def _table_row(m: Measurement) -> str:
    extra = " ".join(f"{k}={v}" for k, v in m.extra.items())
    return (f"{m.measurement:<22} {m.engine:<10} {m.jobs:>9} {m.stale:>7} "
            f"{m.value:>12} {m.unit:<10} {extra}")


def main(argv: list[str] | None = None) -> int:
    """``--source`` picks the job source: a foreign one is measured by benchmarks.foreign
    (with its options), the native one (the default) by everything else here."""
    chosen = argparse.ArgumentParser(prog="python -m benchmarks", add_help=False)
    chosen.add_argument("--source", choices=("native", *SYSTEMS, "rq", "dramatiq", "all"),
                        default="native")
    picked, rest = chosen.parse_known_args(argv)
    if picked.source == "rq":
        return foreign_rq.main(rest)
    if picked.source == "dramatiq":
        return foreign_dramatiq.main(rest)
    if picked.source != "native":
        return foreign.main(["--source", picked.source, *rest])
    return native(rest)


def native(argv: list[str]) -> int:
    """The native source's benchmarks."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=(*ENGINE_RUNS, *ENGINE_NAMES), default="both",
                        help="both: SQLite and PostgreSQL; mariadb: MariaDB beside "
                        "PostgreSQL, in the same run; all: the three")
    parser.add_argument("--database-url",
                        help="an empty PostgreSQL (or MariaDB) database to use")
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--stale", type=int, default=None, help="default: 1%% of --jobs")
    parser.add_argument("--memory", default="1000,100000",
                        help="stale counts for the peak-memory probe")
    parser.add_argument("--peers", action="store_true",
                        help="also measure Procrastinate's stalled-job recovery (PostgreSQL)")
    parser.add_argument("--smoke", action="store_true",
                        help="N = 10k, small memory probe: checks the benchmark runs")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--measure", choices=("pass", "time_to_recovery", "parked", "all"),
                        default="pass", help="the pass's costs (default), recovery after "
                        "workers die with a replica (real processes), held and gated jobs "
                        "left out of the scans, or all three")
    parser.add_argument("--parked", type=int, default=10_000,
                        help="parked: held and gated jobs among --jobs")
    parser.add_argument("--orphans", type=int, default=10_000,
                        help="time_to_recovery: jobs whose workers die")
    parser.add_argument("--replicas", type=int, default=1,
                        help="time_to_recovery: replicas left running after the kill")
    parser.add_argument("--workers", type=int, default=4,
                        help="time_to_recovery: worker processes holding the orphans")
    parser.add_argument("--backlog", type=int, default=100_000,
                        help="backlog_drain: orphans decided by one, then two replicas")
    parser.add_argument("--recovery-timeout", type=float, default=3600.0,
                        help="time_to_recovery: seconds to wait for the last orphan")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress lines on stderr (at least every 10 s otherwise)")
    args = parser.parse_args(argv)
    PROGRESS.enabled = not args.quiet
    jobs = 10_000 if args.smoke else args.jobs
    stale = args.stale if args.stale is not None else max(jobs // 100, 1)
    memory = (100, 1000) if args.smoke else tuple(int(x) for x in args.memory.split(","))
    engines = ENGINE_RUNS.get(args.engine, (args.engine,))

    def emit(m: Measurement) -> None:
        print(m.as_json() if args.json else _table_row(m), flush=True)

    if not args.json:
        print(f"{'measurement':<22} {'engine':<10} {'jobs':>9} {'stale':>7} {'value':>12} "
              f"{'unit':<10} details")
        print(f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}, "
              f"sqlite {__import__('sqlite3').sqlite_version}")
    measures = (("pass", "time_to_recovery", "parked") if args.measure == "all"
                else (args.measure,))
    if "time_to_recovery" in measures and args.database_url:
        parser.error("--measure time_to_recovery makes fresh databases on a throwaway "
                     "server; leave out --database-url")
    plan = plan_for(smoke=args.smoke, orphans=args.orphans, replicas=args.replicas,
                    workers=args.workers, backlog=args.backlog,
                    timeout_seconds=args.recovery_timeout)
    ok = True
    with PROGRESS:
        for name in engines:
            if "pass" in measures:
                run(name, _named_url(args.database_url, name), jobs, stale,
                    memory=memory, peers=args.peers and name == "postgresql", emit=emit)
            if "parked" in measures:
                PROGRESS.phase(f"{name}: held and gated jobs parked")
                emit(measure_parked(name, _named_url(args.database_url, name),
                                    jobs, 1_000 if args.smoke else args.parked))
            if "time_to_recovery" in measures:
                PROGRESS.phase(f"{name}: time to recovery ({plan.orphans} orphans)")
                dbs = Databases(name, None)
                try:
                    ok = run_recovery(dbs, plan, emit) and ok
                finally:
                    dbs.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
