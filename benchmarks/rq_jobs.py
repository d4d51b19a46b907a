"""RQ's keys for the rq benchmark (``benchmarks.foreign_rq``), written by RQ's own classes.

A throwaway redis-server is filled in pipelines: ``Job.create`` and ``save``,
``Job.prepare_for_execution`` and ``Execution.create`` as a worker starts a job,
``FinishedJobRegistry.add``, ``Worker.serialize`` and ``worker_registration.register``
for the workers; and moved as time and death would move it (``keep_alive``, ``kill``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.foreign_base import Size

QUEUES = ("default", "reports", "emails", "payments")
PIPELINE_CHUNK = 2_000
HEARTBEAT_TTL = 90
"""What a worker's heartbeat gives a job (``job_monitoring_interval`` 30 s + RQ's 60)."""
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
