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
  each pass also reads the live entries and asks the ledger which went silent (none).
- ``recovery``: the orphans die; RQ's cleanup runs once over every queue (``peer_value``,
  jobs/s: it fails each as ``AbandonedJobError``); they die again and the reconciler's
  passes resume them (``value``, jobs/s, every decision recorded).

``redis_commands`` and ``redis_usec``: the commands Redis counted and the time it spent
serving them (``INFO commandstats``) per quiet pass, or per recovered job, for each
side: what a pass costs the app's Redis.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.foreign_base import Size
from benchmarks.foreign_python import start_redis
from benchmarks.harness import Databases, row_printer
from reconciler.config.loader import load_config, pass_config
from reconciler.core.passes import PassConfig, run_pass
from reconciler.ledger import Step, StepLedger
from reconciler.root.cli import assemble_cli

FULL = Size(jobs=100_000, running=10_000, orphans=1_000)
SMOKE = Size(jobs=10_000, running=100, orphans=10)
BATCH_SIZE = 500
QUEUES = ("default", "reports", "emails", "payments")
PIPELINE_CHUNK = 2_000
HEARTBEAT_TTL = 90
"""What a worker's heartbeat gives a job (``job_monitoring_interval`` 30 s + RQ's 60)."""
LEDGER_JOBS = 100
"""Finished jobs whose steps the ledger keeps, for ``quiet_pass_ledger``."""
KEPT_SECONDS = 86_400
"""Results and failures kept a day: nothing of the dataset expires during a run."""


class RqJobs:
    """RQ's keys for ``size`` jobs on one Redis, the orphans' workers alive until ``kill``."""

    def __init__(self, url: str, size: Size) -> None:
        import redis  # noqa: PLC0415 - optional, with rq

        self.connection = redis.Redis.from_url(url)
        self.size = size
        self._started: list[Any] = []  # (job, worker name, queue name) of each started job

    def build(self) -> None:
        """Write every job, queue, registry and worker in RQ's own shapes."""
        from rq import Queue  # noqa: PLC0415 - optional
        from rq.job import Job, JobStatus  # noqa: PLC0415
        from rq.registry import FinishedJobRegistry  # noqa: PLC0415

        size = self.size
        waiting_end = size.running + (size.jobs - size.running) // 2
        queues = {name: Queue(name, connection=self.connection) for name in QUEUES}
        finished = {name: FinishedJobRegistry(name, connection=self.connection)
                    for name in QUEUES}
        for chunk in _chunks(size.jobs):
            with self.connection.pipeline(transaction=False) as pipe:
                for n in chunk:
                    name = QUEUES[n % len(QUEUES)]
                    job = Job.create(f"app.tasks.{name}", args=(n,),
                                     connection=self.connection, id=f"bench-{n}",
                                     origin=name, result_ttl=KEPT_SECONDS,
                                     failure_ttl=KEPT_SECONDS,
                                     status=JobStatus.FINISHED if n >= waiting_end
                                     else JobStatus.QUEUED)
                    job.save(pipeline=pipe)
                    if n < size.running:  # started below, as a worker starts it
                        self._started.append((job, _worker_name(n, size), name))
                    elif n < waiting_end:
                        pipe.rpush(queues[name].key, job.id)
                    else:
                        finished[name].add(job, KEPT_SECONDS, pipeline=pipe)
                pipe.sadd("rq:queues", *(q.key for q in queues.values()))
                pipe.execute()
        self._register_workers(self._started, queues)
        self._start(self._started, expired=False)

    def _register_workers(self, started: list[Any], queues: dict[str, Any]) -> None:
        """One worker per started job, registered as ``Worker.register_birth`` does."""
        from rq import Worker, worker_registration  # noqa: PLC0415 - optional
        from rq.utils import now  # noqa: PLC0415

        for chunk in _chunks(len(started)):
            with self.connection.pipeline(transaction=False) as pipe:
                for n in chunk:
                    job, worker_name, queue_name = started[n]
                    worker = Worker([queues[queue_name]], name=worker_name,
                                    connection=self.connection)
                    worker.birth_date = worker.last_heartbeat = now()
                    pipe.hset(worker.key, mapping=worker.serialize())
                    pipe.hset(worker.key, "current_job", job.id)
                    worker_registration.register(worker, pipe)
                    pipe.expire(worker.key, worker.worker_ttl + 60)
                pipe.execute()

    def _start(self, started: list[Any], *, expired: bool) -> None:
        """Each job started by its worker as RQ's worker starts it (the job's fields, an
        execution in its started registry); ``expired``: entries a second past expiry."""
        from rq.executions import Execution  # noqa: PLC0415 - optional

        for chunk in _chunks(len(started)):
            with self.connection.pipeline(transaction=False) as pipe:
                for n in chunk:
                    job, worker_name, _ = started[n]
                    job.prepare_for_execution(worker_name, pipeline=pipe)
                    execution = Execution.create(job, HEARTBEAT_TTL, pipeline=pipe,
                                                 worker_name=worker_name)
                    if expired:
                        pipe.zadd(job.started_job_registry.key,
                                  {execution.composite_key: time.time() - 1}, xx=True)
                pipe.execute()

    def keep_alive(self) -> None:
        """Every live worker's heartbeat: its entry's expiry pushed forward, its worker's
        ``last_heartbeat`` now."""
        from rq.registry import StartedJobRegistry  # noqa: PLC0415 - optional
        from rq.utils import now, utcformat  # noqa: PLC0415

        live = self._started[self.size.orphans:]
        live_ids = {job.id for job, _, _ in live}
        expiry, stamp = time.time() + HEARTBEAT_TTL, utcformat(now())
        with self.connection.pipeline(transaction=False) as pipe:
            for name in QUEUES:
                key = StartedJobRegistry(name, connection=self.connection).key
                entries = [e for e in self.connection.zrange(key, 0, -1)
                           if e.decode().split(":", 1)[0] in live_ids]
                if entries:
                    pipe.zadd(key, dict.fromkeys(entries, expiry), xx=True)
            for _, worker_name, _ in live:
                pipe.hset(f"rq:worker:{worker_name}", "last_heartbeat", stamp)
            pipe.execute()

    def kill(self) -> None:
        """The orphans' workers gone (their keys deleted, as a worker's own TTL would) and
        their jobs started afresh with entries a second past expiry (their earlier
        executions removed); failed-registry entries from an earlier recovery removed."""
        from rq import worker_registration  # noqa: PLC0415 - optional
        from rq.registry import StartedJobRegistry  # noqa: PLC0415

        orphans = self._started[:self.size.orphans]
        ids = {job.id for job, _, _ in orphans}
        with self.connection.pipeline(transaction=False) as pipe:
            for name in QUEUES:  # the live run's execution, replaced by the dead one's
                key = StartedJobRegistry(name, connection=self.connection).key
                for entry in self.connection.zrange(key, 0, -1):
                    if entry.decode().split(":", 1)[0] in ids:
                        pipe.zrem(key, entry)
                        pipe.delete(f"rq:execution:{entry.decode()}")
            for job, worker_name, queue_name in orphans:
                pipe.zrem(f"rq:failed:{queue_name}", job.id)
                pipe.delete(f"rq:worker:{worker_name}")
                pipe.srem(worker_registration.REDIS_WORKER_KEYS, f"rq:worker:{worker_name}")
                pipe.srem(worker_registration.WORKERS_BY_QUEUE_KEY % queue_name,
                          f"rq:worker:{worker_name}")
                pipe.lrem(f"rq:queue:{queue_name}", 0, job.id)
            pipe.execute()
        self._start(orphans, expired=True)

    def cleanup(self) -> None:
        """RQ's own: ``StartedJobRegistry.cleanup`` on every queue, as each worker's
        maintenance runs it on its queues."""
        from rq.registry import StartedJobRegistry  # noqa: PLC0415 - optional

        # Its warning a job is one line on stderr through logging's last resort here:
        # a terminal's speed is not RQ's.
        logger = logging.getLogger("rq.registry")
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            for name in QUEUES:
                StartedJobRegistry(name, connection=self.connection).cleanup()
        finally:
            logger.setLevel(level)

    def orphans_in(self, *statuses: str) -> int:
        """How many orphans have one of ``statuses``."""
        with self.connection.pipeline(transaction=False) as pipe:
            for job, _, _ in self._started[:self.size.orphans]:
                pipe.hget(job.key, "status")
            return sum(1 for s in pipe.execute() if s is not None and s.decode() in statuses)

    @contextlib.contextmanager
    def counting(self) -> Iterator[list[int]]:
        """The commands Redis served while the block ran and the microseconds it spent on
        them, in a two-item list."""
        self.connection.config_resetstat()
        counted = [0, 0]
        yield counted
        stats = {k: v for k, v in self.connection.info("commandstats").items()
                 if k not in ("cmdstat_info", "cmdstat_config")}
        counted[0] = sum(v["calls"] for v in stats.values())
        counted[1] = sum(v["usec"] for v in stats.values())


def _worker_name(n: int, size: Size) -> str:
    return f"bench-dead-{n}" if n < size.orphans else f"bench-live-{n}"


def _chunks(count: int) -> Iterator[range]:
    for start in range(0, count, PIPELINE_CHUNK):
        yield range(start, min(start + PIPELINE_CHUNK, count))


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
        with jobs.counting() as ours_sent:
            ours = statistics.median(_timed_ms(lambda: _quiet(store, pass_cfg), runs))
        emit(_quiet_row(base, "quiet_pass", ours=ours, peer=peer, ours_sent=ours_sent,
                        peer_sent=peer_sent, runs=runs))
        ledger_store, ledger_cfg = _store(tmp / "ledger.toml", url, engine,
                                          "stale_after_seconds = 0.5\nwedged_after_seconds = 1\n")
        _finished_steps(engine)
        jobs.keep_alive()
        with jobs.counting() as ours_sent:
            ours = statistics.median(_timed_ms(lambda: _quiet(ledger_store, ledger_cfg), runs))
        emit(_quiet_row(base, "quiet_pass_ledger", ours=ours, peer=peer, ours_sent=ours_sent,
                        peer_sent=peer_sent, runs=runs))

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


def _quiet_row(base: dict[str, Any], measurement: str, *, ours: float, peer: float,
               ours_sent: list[int], peer_sent: list[int], runs: int) -> dict[str, Any]:
    # the warm-up is one more than ``runs``
    return {**base, "measurement": measurement, "orphans": 0, "value": round(ours, 2),
            "unit": "ms", "peer_value": round(peer, 2), "ratio_to_peer": round(ours / peer, 2),
            "runs": runs, "redis_commands": round(ours_sent[0] / (runs + 1), 1),
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
