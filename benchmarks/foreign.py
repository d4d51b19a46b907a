"""Each foreign source at a million rows, beside the system's own stalled-job mechanism
(Django's tasks and Celery have none: beside the sweep a team writes instead).

    python -m benchmarks.foreign --source procrastinate|graphile-worker|pg-boss|table|
                                          django-tasks|celery|all
    python -m benchmarks.foreign --smoke      # 10k jobs per system: checks it runs
    python -m benchmarks.foreign --with-index # with the index docs/sources.md suggests
    python -m benchmarks.foreign --named-kind report  # [kinds] naming a kind beside "*"

For each system, on a throwaway PostgreSQL 15 (Debian's binaries, tests/pg_server.py), one
database holds the reconciler's own tables and the system's schema, built by the system's
own code and filled with ``--jobs`` jobs, ``--running`` of them claimed and ``--orphans``
of those on an owner that dies (benchmarks/foreign_systems.py, benchmarks/foreign_python.py).
In one run:

- ``quiet_pass``: median of ``--runs`` real passes through the configured source (the
  reconciler's ``run_pass``: pass record, scans, audit) with nothing to recover; its
  ``peer_value`` is the median of the system's own sweep over the same rows.
- ``job_table_reads``: on both measurements, the statements per pass that read the
  system's job table (a read of the running jobs each, sequential where the system keeps
  no index on its claimed jobs): ``quiet`` over the quiet passes, ``recovering`` over the
  passes that decided something.
- ``recovery``: the orphans' owners die; the system's own recovery runs over them once
  (``peer_value``, jobs/s); they die again and the reconciler's passes recover them
  (``value``, jobs/s, every decision recorded), with the statements it sent per job.
  Where death is a silence the reconciler must see across passes (Celery), one untimed
  pass sees it first, and the timing starts ``session_timeout_seconds`` later.

Ratios, not absolute times, carry over between machines: both sides run on the same rows
of the same server, one after the other.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.foreign_base import Size, System
from benchmarks.foreign_python import SYSTEMS
from benchmarks.harness import counting_statements, job_table_reads, row_printer
from reconciler.config.loader import load_config, pass_config
from reconciler.core.passes import PassConfig, run_pass
from reconciler.root.cli import assemble_cli
from reconciler.storage.engines import UNLIMITED_TIMEOUTS, create_engine
from reconciler.storage.schema import upgrade

BATCH_SIZE = 500
FULL = Size(jobs=1_000_000, running=10_000, orphans=1_000)
SMOKE = Size(jobs=10_000, running=100, orphans=10)
JOB_TABLES = {"procrastinate": "procrastinate_jobs", "graphile-worker": "_private_jobs",
              "pg-boss": "job", "table": "jobs",
              "django-tasks": "django_tasks_database_dbtaskresult", "celery": "celery_taskmeta"}
"""Each system's job table, as its source's statements name it."""
NAMED_KIND = '[kinds."{}"]\nmax_run_seconds = 3600\n'
"""A kind of its own beside ``"*"``, as a real ``[kinds]`` has: the source reads the
running kinds and judges each by its own lease (an hour: past the live claims' age, short
of the orphans' five hours)."""



def _quiet_ms(store: Any, config: PassConfig, runs: int) -> list[float]:
    run_pass(store, config)  # warm: statement caches, the pass row's first insert
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        report = run_pass(store, config)
        samples.append((time.perf_counter() - started) * 1000)
        if report.decisions:
            raise RuntimeError("the quiet pass found jobs to decide")
    return samples


def _drain(store: Any, config: PassConfig, sent: list[str], table: str
           ) -> tuple[int, int, int, list[int]]:
    """Passes until one decides less than a batch: (decided, acted on, passes, the job
    table's reads of each pass that decided something)."""
    decided = acted = passes = 0
    reads: list[int] = []
    while True:
        before = len(sent)
        report = run_pass(store, config)
        passes += 1
        decided += len(report.decisions)
        acted += sum(1 for d in report.decisions if d.disposition.value != "skip")
        if report.decisions:
            reads.append(job_table_reads(sent[before:], table))
        if len(report.decisions) < config.batch_size:
            return decided, acted, passes, reads


def measure(name: str, size: Size, runs: int, emit: Callable[[dict[str, Any]], None], *,
            with_index: bool = False, named_kind: str | None = None) -> None:
    """Quiet pass and recovery for one system, each beside its own mechanism; with the
    index docs/sources.md suggests added first when ``with_index``; with ``[kinds]``
    naming ``named_kind`` beside ``"*"`` when given."""
    from tests.pg_server import ThrowawayPostgres  # noqa: PLC0415 - the benchmark's server

    system: System = SYSTEMS[name]()
    with ThrowawayPostgres() as server, tempfile.TemporaryDirectory() as tmp, \
            contextlib.closing(system):
        server.create_database("bench")
        url, conninfo = server.url("bench"), f"{server.dsn} dbname=bench"
        engine = create_engine(url, timeouts=UNLIMITED_TIMEOUTS)
        upgrade(engine)
        system.build(conninfo, size)
        if with_index and system.user_index is not None:
            with psycopg.connect(conninfo, autocommit=True) as conn:
                conn.execute(system.user_index)
                conn.execute("ANALYZE")
        config_file = Path(tmp) / "reconciler.toml"
        config_file.write_text(system.source_toml + (NAMED_KIND.format(named_kind)
                                                     if named_kind else ""))
        config = load_config(config_file, database_url=url, batch_size=BATCH_SIZE)
        store = assemble_cli(config, engine=engine).passes
        pass_cfg = pass_config(config.settings, "bench", config.kinds)
        base = {"source": name, "jobs": size.jobs, "running": size.running,
                "user_index": with_index and system.user_index is not None,
                "named_kind": named_kind}

        system.keep_alive(conninfo)
        table = JOB_TABLES[name]
        with counting_statements(engine) as quiet_sent:
            ours = statistics.median(_quiet_ms(store, pass_cfg, runs))
        peer = statistics.median(system.peer_quiet(conninfo, runs))
        emit({**base, "measurement": "quiet_pass", "orphans": 0, "value": round(ours, 2),
              "unit": "ms", "peer_value": round(peer, 2),
              "ratio_to_peer": round(ours / peer, 2), "runs": runs,
              # the warm-up pass is one more than ``runs``
              "job_table_reads": round(job_table_reads(quiet_sent, table) / (runs + 1), 2)})

        system.kill(conninfo, size)
        peer_seconds, peer_recovered = system.peer_recover(conninfo, size)
        if peer_recovered != size.orphans:
            raise RuntimeError(f"{name}'s own recovery took {peer_recovered} of "
                               f"{size.orphans} orphans")
        system.kill(conninfo, size)
        if system.silence_seconds:
            if run_pass(store, pass_cfg).decisions:
                raise RuntimeError("a pass decided before the owners' silence timed out")
            time.sleep(system.silence_seconds)
        with counting_statements(engine) as sent:
            started = time.perf_counter()
            decided, acted, passes, reads = _drain(store, pass_cfg, sent, table)
            seconds = time.perf_counter() - started
        if acted != size.orphans:
            raise RuntimeError(f"the reconciler recovered {acted} of {size.orphans} orphans "
                               f"through the {name} source ({decided} decisions)")
        emit({**base, "measurement": "recovery", "orphans": size.orphans,
              "value": round(acted / seconds), "unit": "jobs/s",
              "peer_value": round(peer_recovered / peer_seconds),
              "ratio_to_peer": round((acted / seconds) / (peer_recovered / peer_seconds), 3),
              "statements_per_job": round(len(sent) / acted, 2), "passes": passes,
              "job_table_reads": round(statistics.mean(reads), 2) if reads else 0,
              "seconds": round(seconds, 3), "peer_seconds": round(peer_seconds, 3)})
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    """Measure the chosen sources; a table, or one JSON object per line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.foreign", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=(*SYSTEMS, "all"), default="all")
    parser.add_argument("--jobs", type=int, default=FULL.jobs)
    parser.add_argument("--running", type=int, default=FULL.running)
    parser.add_argument("--orphans", type=int, default=FULL.orphans)
    parser.add_argument("--runs", type=int, default=15, help="quiet passes per side")
    parser.add_argument("--smoke", action="store_true", help="10k jobs: checks it runs")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--with-index", action="store_true",
                        help="add the index docs/sources.md suggests for the system first")
    parser.add_argument("--named-kind", metavar="KIND",
                        help="[kinds] names KIND (max_run_seconds = 3600) beside \"*\"")
    args = parser.parse_args(argv)
    size = SMOKE if args.smoke else Size(args.jobs, args.running, args.orphans)
    runs = 3 if args.smoke else args.runs
    if not 0 < size.orphans <= size.running <= size.jobs:
        parser.error("need 0 < --orphans <= --running <= --jobs")

    emit = row_printer(args.json, 16)

    for name in SYSTEMS if args.source == "all" else (args.source,):
        measure(name, size, runs, emit, with_index=args.with_index,
                named_kind=args.named_kind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
