"""RQ at a hundred thousand jobs, beside RQ's own ``StartedJobRegistry.cleanup``.

    python -m benchmarks --source rq [--engine sqlite|postgresql|both] [--smoke]

A throwaway redis-server holds RQ's keys, written in pipelines by RQ's own classes
(``Job.create`` and ``save``, ``Job.prepare_for_execution`` and ``Execution.create`` as a
worker starts a job, ``FinishedJobRegistry.add``, ``Worker.serialize`` and
``worker_registration.register`` for the workers): ``--jobs`` jobs over four queues,
``--running`` of them started by a live worker each, ``--orphans`` of those on workers
that die, the rest half queued and half finished. The reconciler's own tables are on
``--engine`` (a fresh SQLite file, or a throwaway PostgreSQL), as a sidecar keeps them.

A dead worker's registry entry expires about 60 s after its last renewal (RQ adds a
fixed minute to the heartbeat's TTL), and neither RQ's cleanup nor the reconciler can
tell the job dead before that. The benchmark does not wait out that minute: ``kill``
deletes the orphans' worker keys (the worker gone) and moves their entries' scores a
second into the past (what the minute would have done), the same rows for both sides.

In one run, per engine:

- ``quiet_pass``: median of ``--runs`` real passes through the ``rq`` source with
  nothing to recover; ``peer_value``: median of RQ's ``StartedJobRegistry.cleanup`` over
  every queue (what each worker's maintenance runs), nothing expired.
- ``quiet_pass_ledger``: the same, once the step ledger is in use: ``LEDGER_JOBS``
  finished jobs' steps recorded longer ago than ``wedged_after_seconds`` (1 s here), so
  a pass also reads again the live entries found silent (none) and, once a
  ``SILENT_REREAD_SECONDS``, every live entry, asking the ledger which went silent
  (``quiet_pass_ledger_reread``: that pass).
- ``recovery``: the orphans die; RQ's cleanup runs once over every queue (``peer_value``,
  jobs/s: it fails each as ``AbandonedJobError``); they die again and the reconciler's
  passes resume them (``value``, jobs/s, every decision recorded).

``redis_commands`` and ``redis_usec``: the commands Redis counted and the time it spent
serving them (``INFO commandstats``) per quiet pass, or per recovered job, for each
side: what a pass costs the app's Redis. ``statements``: the statements a quiet pass
sent to the reconciler's own database (its transaction's ``BEGIN`` and ``COMMIT`` aside).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.foreign_base import Size
from benchmarks.foreign_python import start_redis
from benchmarks.harness import Databases, counting_statements, row_printer
from benchmarks.rq_jobs import RqJobs
from reconciler.config.loader import load_config, pass_config
from reconciler.core.passes import PassConfig, run_pass
from reconciler.ledger import Step, StepLedger
from reconciler.root.cli import assemble_cli
from reconciler.sources.rq import snapshot

FULL = Size(jobs=100_000, running=10_000, orphans=1_000)
SMOKE = Size(jobs=10_000, running=100, orphans=10)
BATCH_SIZE = 500
LEDGER_JOBS = 100
"""Finished jobs whose steps the ledger keeps, for ``quiet_pass_ledger``."""


def _timed_ms(func: Callable[[], Any], runs: int) -> list[float]:
    func()  # warm: connections, statement caches, the pass row's first insert
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        func()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def _quiet(store: Any, config: PassConfig) -> None:
    if run_pass(store, config).decisions:
        raise RuntimeError("the quiet pass found jobs to decide")


def _drain(store: Any, config: PassConfig) -> tuple[int, int]:
    """Passes until one decides less than a batch: (acted on, passes)."""
    acted = passes = 0
    while True:
        report = run_pass(store, config)
        passes += 1
        acted += sum(1 for d in report.decisions if d.disposition.value != "skip")
        if len(report.decisions) < config.batch_size:
            return acted, passes


def measure(engine_name: str, size: Size, runs: int,
            emit: Callable[[dict[str, Any]], None]) -> None:
    """Quiet pass and recovery on one engine for the reconciler's tables, each beside RQ's
    cleanup over the same jobs."""
    with contextlib.ExitStack() as stack:
        url = start_redis(stack, "rq")
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        dbs = Databases(engine_name, None)
        stack.callback(dbs.close)
        engine = stack.enter_context(dbs.fresh())
        jobs = RqJobs(url, size)
        jobs.build()
        store, pass_cfg = _store(tmp / "reconciler.toml", url, engine, "")
        base = {"source": "rq", "engine": engine_name, "jobs": size.jobs,
                "running": size.running}

        jobs.keep_alive()
        with jobs.counting() as peer_sent:
            peer = statistics.median(_timed_ms(jobs.cleanup, runs))

        def quiet(measurement: str, pass_store: Any, config: PassConfig) -> None:
            """``runs`` quiet passes through ``pass_store``, beside RQ's cleanup's."""
            with jobs.counting() as ours_sent, counting_statements(engine) as sql:
                ours = statistics.median(_timed_ms(lambda: _quiet(pass_store, config), runs))
            emit(_quiet_row(base, measurement, ours=ours, peer=peer, ours_sent=ours_sent,
                            peer_sent=peer_sent, sql=sql, runs=runs))

        quiet("quiet_pass", store, pass_cfg)
        ledger_store, ledger_cfg = _store(tmp / "ledger.toml", url, engine,
                                          "stale_after_seconds = 0.5\nwedged_after_seconds = 1\n")
        _finished_steps(engine)
        jobs.keep_alive()
        quiet("quiet_pass_ledger", ledger_store, ledger_cfg)
        # The pass that reads every live entry again (once a ``SILENT_REREAD_SECONDS``).
        with _rereading():
            quiet("quiet_pass_ledger_reread", ledger_store, ledger_cfg)

        # Before each side: the live workers heartbeat, so only the orphans have expired
        # however long the quiet passes took.
        jobs.keep_alive()
        jobs.kill()
        with jobs.counting() as peer_sent:
            started = time.perf_counter()
            jobs.cleanup()
            peer_seconds = time.perf_counter() - started
        peer_recovered = jobs.orphans_in("failed", "queued")
        if peer_recovered != size.orphans:
            raise RuntimeError(f"RQ's cleanup took {peer_recovered} of {size.orphans} orphans")
        jobs.keep_alive()
        jobs.kill()
        with jobs.counting() as ours_sent:
            started = time.perf_counter()
            acted, passes = _drain(store, pass_cfg)
            seconds = time.perf_counter() - started
        if acted != size.orphans or jobs.orphans_in("queued") != size.orphans:
            raise RuntimeError(f"the reconciler recovered {acted} of {size.orphans} orphans "
                               "through the rq source")
        emit({**base, "measurement": "recovery", "orphans": size.orphans,
              "value": round(acted / seconds), "unit": "jobs/s",
              "peer_value": round(peer_recovered / peer_seconds),
              "ratio_to_peer": round((acted / seconds) / (peer_recovered / peer_seconds), 3),
              "passes": passes, "seconds": round(seconds, 3),
              "peer_seconds": round(peer_seconds, 3),
              "redis_commands_per_job": round(ours_sent[0] / acted, 1),
              "peer_redis_commands_per_job": round(peer_sent[0] / peer_recovered, 1),
              "redis_usec_per_job": round(ours_sent[1] / acted, 1),
              "peer_redis_usec_per_job": round(peer_sent[1] / peer_recovered, 1)})


def _store(path: Path, url: str, engine: Any, kinds: str) -> tuple[Any, PassConfig]:
    """A pass store for the rq source over ``url`` (every kind idempotent, and ``kinds``
    more of ``[kinds."*"]``), and its pass settings."""
    path.write_text(f'[source]\nkind = "rq"\nredis_url = "{url}"\n'
                    f'[kinds."*"]\neffect = "idempotent"\n{kinds}')
    config = load_config(path, database_url=str(engine.url), batch_size=BATCH_SIZE)
    return (assemble_cli(config, engine=engine).passes,
            pass_config(config.settings, "bench", config.kinds))


def _finished_steps(engine: Any) -> None:
    """``LEDGER_JOBS`` finished jobs' steps in the ledger, older than a second."""
    with StepLedger(engine) as ledger:
        for n in range(LEDGER_JOBS):
            run = ledger.run("rq", f"finished-{n}", 1, [Step("work", "effectful")])
            with run.step(0):
                pass
    time.sleep(1.1)


@contextlib.contextmanager
def _rereading() -> Iterator[None]:
    """Every pass reads every live entry again, as one pass a minute does."""
    kept = snapshot.SILENT_REREAD_SECONDS
    snapshot.SILENT_REREAD_SECONDS = 0.0
    try:
        yield
    finally:
        snapshot.SILENT_REREAD_SECONDS = kept


def _quiet_row(base: dict[str, Any], measurement: str, *, ours: float, peer: float,
               ours_sent: list[int], peer_sent: list[int], sql: list[str], runs: int
               ) -> dict[str, Any]:
    # the warm-up is one more than ``runs``
    return {**base, "measurement": measurement, "orphans": 0, "value": round(ours, 2),
            "unit": "ms", "peer_value": round(peer, 2), "ratio_to_peer": round(ours / peer, 2),
            "runs": runs, "statements": round(len(sql) / (runs + 1), 1),
            "redis_commands": round(ours_sent[0] / (runs + 1), 1),
            "peer_redis_commands": round(peer_sent[0] / (runs + 1), 1),
            "redis_usec": round(ours_sent[1] / (runs + 1), 1),
            "peer_redis_usec": round(peer_sent[1] / (runs + 1), 1)}


def main(argv: list[str] | None = None) -> int:
    """Measure the rq source on the chosen engines; a table, or one JSON object a line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks --source rq",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("sqlite", "postgresql", "both"),
                        default="sqlite", help="where the reconciler's own tables are")
    parser.add_argument("--jobs", type=int, default=FULL.jobs)
    parser.add_argument("--running", type=int, default=FULL.running)
    parser.add_argument("--orphans", type=int, default=FULL.orphans)
    parser.add_argument("--runs", type=int, default=15, help="quiet passes per side")
    parser.add_argument("--smoke", action="store_true", help="10k jobs: checks it runs")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    size = SMOKE if args.smoke else Size(args.jobs, args.running, args.orphans)
    if not 0 < size.orphans <= size.running <= size.jobs:
        parser.error("need 0 < --orphans <= --running <= --jobs")
    emit = row_printer(args.json, 4)
    engines = ("sqlite", "postgresql") if args.engine == "both" else (args.engine,)
    for engine_name in engines:
        measure(engine_name, size, 3 if args.smoke else args.runs, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
