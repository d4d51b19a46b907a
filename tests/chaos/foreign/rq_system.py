"""RQ in the foreign chaos runs: a redis-server of the run's own (append-only file fsynced
at every write, as a Redis that keeps an RQ app's jobs is run, so its crash and restart
loses nothing acknowledged), ``rq worker -w rq.worker.SimpleWorker`` processes (the job
runs in the worker's own process, as Celery's solo pool: the markers name the pid the run
kills), jobs enqueued through ``Queue.enqueue`` with ``Retry(max=budget - 1)``
(tests/chaos/foreign/rq_chaos_tasks.py).

**RQ's timeline, compressed.** A dead worker's started-registry entry is scored its next
heartbeat's due time plus RQ's fixed 60 s (a SimpleWorker's, which beats not at all inside
a job: the job's timeout + 60 s), and its worker key expires with it. The reconciler
decides once the heartbeat is ``session_timeout_seconds`` overdue; RQ's own cleanup (a
worker's start-up ``StartedJobRegistry.cleanup``, and a successor under the dead worker's
name can start only once its key expired) once the entry expired, about a minute later.
The run does not wait for the heartbeat's due time: when a worker dies (the run's
SIGKILL, or an exit of its own) or is SIGSTOPped past the reconciler's wait, ``age``
scores that worker's entries as a heartbeat that fell due ``AGED_OVERDUE_SECONDS`` past the
session timeout ago would leave them (expiring about a minute on), sets its key to expire
with them, and touches nothing else (its job and execution stay as the death left them).
The reconciler still judges both signals: the entry's heartbeat overdue and the worker
silent past ``session_timeout_seconds``. Live workers' entries are never touched, and RQ's
own maintenance runs beside the replicas and takes an aged job once its entry expires, if
no replica decided it first (that is RQ's behaviour, not ours). Worker slot 0 runs under a
fixed name, restarted by the run as a supervisor does: RQ refuses it (``NAME_TAKEN``) until
the dead one's key expires, then the start that succeeds runs RQ's cleanup first.
A job its worker took and died with before starting it is RQ's alone to end (a minute on,
``IntermediateQueue.cleanup``): the drain runs that handling, compressed (``maintain``).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from reconciler.sources.rq.keys import HEARTBEAT_GRACE_SECONDS
from tests.chaos.foreign.database import Database
from tests.chaos.foreign.processes import die_with_parent
from tests.chaos.foreign.python_systems import REDIS_HINT, _free_port, stop_redis
from tests.chaos.foreign.systems import JobSpec, JobState, SystemBase, UnavailableError

QUEUE = "chaos"
TASKS = "tests.chaos.foreign.rq_chaos_tasks."
JOB_TIMEOUT_SECONDS = 20
"""A job's timeout: a SimpleWorker's entry lasts this + 60 s unless aged."""
REDIS_RETRY_SECONDS = 30.0
WORKER_KEYS = "rq:worker:chaos-"
"""The run's workers' keys (RQ's ``rq:worker:<name>``, each name ``chaos-<8 hex>``)."""
SESSION_TIMEOUT_SECONDS = 0.6
"""Short (twice the replicas' 0.3 s session heartbeat, the least a config may set):
only aged entries are candidates, and only dead or long-stopped workers' are aged, so a
live worker's silence inside a job (a SimpleWorker does not heartbeat there) decides
nothing; and the replicas decide about a minute before RQ's own cleanup can take an aged
job the RQ way."""
AGED_OVERDUE_SECONDS = 0.4
"""How far past the session timeout an aged entry's heartbeat is overdue: a pass decides
it at once, and RQ's own cleanup only once it expires, ``HEARTBEAT_GRACE_SECONDS`` less the
session timeout and this later."""
FIXED_NAME_SLOTS = 1
"""Worker slots restarted under one fixed name each (as systemd, ``docker restart`` or a
supervisor does), the others under a new name each start."""
NAME_TAKEN = "There exists an active worker named"
"""The line RQ ends a worker's start with while a worker of its name is still registered."""
STUCK_SECONDS = 5.0
"""A job held only on RQ's intermediate queue this long is its dead worker's: a live one
takes it out (its next two pipelines) within milliseconds of taking it; RQ's own
maintenance waits a minute from first seeing it there (``IntermediateQueue.cleanup``)."""
T = TypeVar("T")


class Rq(SystemBase):
    """RQ 2.x: attempts ``budget - retries_left`` (a resume uses one retry), a job's end
    written by id only."""

    name = "rq"
    completion_fenced = False  # the worker's handle_job_success writes by id

    def __init__(self, session_timeout_seconds: float = SESSION_TIMEOUT_SECONDS) -> None:
        self.session_timeout_seconds = session_timeout_seconds
        # Once an entry is aged: the worker's silence past the session timeout, a pass.
        self.reclaim_after_seconds = session_timeout_seconds + 1.0
        self.redis: subprocess.Popen[bytes] | None = None
        self.redis_dir: Path | None = None
        self.port = 0
        self.url = ""
        self.feeder: threading.Thread | None = None
        self.stopping = threading.Event()
        self.held_since: dict[str, float] = {}  # maintain: first seen held only there

    # -- the store ------------------------------------------------------------------------

    def prepare(self, db: Database) -> None:
        if shutil.which("redis-server") is None:
            raise UnavailableError(REDIS_HINT.replace("Celery", "RQ"))
        try:
            import rq  # noqa: F401, PLC0415 - only a presence check
        except ImportError as exc:
            raise UnavailableError("rq is not installed: pip install -e '.[test]'") from exc
        self.redis_dir = Path(tempfile.mkdtemp(prefix="chaos-rq-redis-"))
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._start_redis()

    def _start_redis(self) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None
        assert self.redis_dir is not None
        self.redis = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.redis_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent)  # noqa: PLW1509 - started from the main thread
        deadline = time.monotonic() + 20
        while not self._ping():
            if time.monotonic() > deadline or self.redis.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def _ping(self) -> bool:
        import redis  # noqa: PLC0415 - optional (with rq)

        try:
            return bool(redis.Redis.from_url(self.url).ping())
        except (redis.ConnectionError, redis.exceptions.BusyLoadingError):
            return False

    def restart_store(self) -> bool:
        """Redis crashes (SIGKILL) and comes back on the same port from its append-only
        file."""
        assert self.redis is not None
        self.redis.kill()
        self.redis.wait(timeout=10)
        self._start_redis()
        return True

    def _redis(self, action: Callable[[Any], T]) -> T:
        """``action(client)``, retried while Redis restarts."""
        import redis  # noqa: PLC0415 - optional (with rq)

        deadline = time.monotonic() + REDIS_RETRY_SECONDS
        while True:
            try:
                return action(redis.Redis.from_url(self.url))
            except (redis.ConnectionError, redis.exceptions.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def close(self) -> None:
        self.stopping.set()
        if self.feeder is not None:
            self.feeder.join(timeout=30)
        stop_redis(self.redis, self.redis_dir)

    # -- the run's config -----------------------------------------------------------------

    def source_table(self) -> dict[str, str]:
        return {"redis_url": self.url}

    def settings(self) -> dict[str, float]:
        return {"session_timeout_seconds": self.session_timeout_seconds}

    def kind_rule(self) -> dict[str, float]:
        return {}  # each job's budget is its own Retry

    def kind_pattern(self, pattern: str) -> str:
        # A job's kind is its function's path: idem.* is ...rq_chaos_tasks.idem_*.
        return TASKS + pattern.replace(".", "_")

    # -- jobs and workers -----------------------------------------------------------------

    def enqueue(self, db: Database, jobs: Sequence[JobSpec]) -> list[str]:
        """Job ids chosen now; each job enqueued through RQ when it is due, by a thread (a
        scheduled job would need a worker running RQ's scheduler)."""
        ids = [uuid.uuid4().hex for _ in jobs]
        schedule = sorted(zip((s.delay_seconds for s in jobs), ids, jobs, strict=True))
        self.feeder = threading.Thread(target=self._feed, args=(schedule,), daemon=True)
        self.feeder.start()
        return ids

    def _feed(self, schedule: list[tuple[float, str, JobSpec]]) -> None:
        from rq import Queue, Retry  # noqa: PLC0415 - optional

        started = time.monotonic()
        for delay, job, spec in schedule:
            if self.stopping.wait(max(0.0, started + delay - time.monotonic())):
                return
            self._redis(lambda client, job=job, spec=spec: Queue(QUEUE, connection=client)
                        .enqueue(TASKS + spec.kind.replace(".", "_"),
                                 kwargs={"hang": list(spec.hang),
                                         "budget": spec.max_attempts},
                                 job_id=job, retry=Retry(max=spec.max_attempts - 1),
                                 job_timeout=JOB_TIMEOUT_SECONDS, result_ttl=-1))

    def worker_command(self, db: Database, markers: Path, slot: int = 0
                       ) -> tuple[list[str], dict[str, str]]:
        # A fixed name for the first slots, else a new one each start (RQ refuses a
        # second live worker of one name).
        prefix = WORKER_KEYS.removeprefix("rq:worker:")
        name = (f"{prefix}fixed{slot}" if slot < FIXED_NAME_SLOTS
                else f"{prefix}{uuid.uuid4().hex[:8]}")
        return [sys.executable, "-m", "rq.cli", "worker", "--url", self.url,
                "-w", "rq.worker.SimpleWorker", "--name", name,
                "--logging_level", "INFO", QUEUE], {"SOURCES_MARKERS": str(markers)}

    def age(self, pid: int) -> None:
        """The started-registry entries of the worker ``pid`` scored, and its key set to
        expire, as a heartbeat overdue ``AGED_OVERDUE_SECONDS`` past the session timeout
        leaves them (module docstring)."""
        from rq.registry import StartedJobRegistry  # noqa: PLC0415 - optional

        left = HEARTBEAT_GRACE_SECONDS - self.session_timeout_seconds - AGED_OVERDUE_SECONDS

        def aged(client: Any) -> None:
            # Every worker key of the run, not RQ's set of live workers: one that quits on
            # an error of its own (Redis gone under it) registers its death and leaves
            # that set, and its key stays a minute with its pid.
            workers = [w.decode() for w in client.scan_iter(match=f"{WORKER_KEYS}*")]
            names = {w.removeprefix("rq:worker:") for w, p in
                     zip(workers, (client.hget(w, "pid") for w in workers), strict=True)
                     if p is not None and int(p) == pid}
            registry = StartedJobRegistry(QUEUE, connection=client)
            for name in names:
                client.expire(f"rq:worker:{name}", max(1, round(left)))
            for entry in client.zrange(registry.key, 0, -1):
                owner = client.hget(f"rq:execution:{entry.decode()}", "worker_name")
                if owner is not None and owner.decode() in names:
                    # Ahead of now, never behind it: RQ's cleanup reads the entries expired
                    # by its timestamp (whole seconds), handles them, then removes every
                    # entry up to that timestamp; a score moved back below the timestamp
                    # of a cleanup running at this instant would be removed unhandled.
                    client.zadd(registry.key, {entry: time.time() + left}, xx=True)

        self._redis(aged)

    def maintain(self) -> None:
        """RQ's own handling of a job its worker took and died with before starting it
        (no reconciler sees it: RQ's status is still ``queued``, and the source reads
        ``started`` jobs only), its minute compressed to ``STUCK_SECONDS`` as ``age``
        compresses the started registry's. Such a job sits on RQ's intermediate queue
        (the worker's ``LMOVE``), with no started entry or with one its worker made just
        before dying, aged by the run; RQ's maintenance in a live fleet
        (``IntermediateQueue.cleanup``, ``StartedJobRegistry.cleanup``) handles it a
        minute on: requeued with a retry used, or failed when none is left (RQ's loss).
        Only jobs seen so for that long are handled, never one a live worker holds (its
        entry is not expired) nor one that started (the reconciler's)."""
        from rq import Queue  # noqa: PLC0415 - optional
        from rq.worker import SimpleWorker  # noqa: PLC0415 - optional

        def handle(client: Any) -> None:
            queued = {j.decode() for j in client.lrange(f"rq:queue:{QUEUE}", 0, -1)}
            held = {j.decode() for j in client.lrange(f"rq:queue:{QUEUE}:intermediate", 0, -1)}
            registry = f"rq:wip:{QUEUE}"
            # A live worker's entry lies a job's timeout and RQ's minute ahead; an aged
            # one, less than RQ's minute.
            aged_until = time.time() + HEARTBEAT_GRACE_SECONDS
            live = {e.decode().split(":", 1)[0]
                    for e in client.zrangebyscore(registry, f"({aged_until}", "+inf")}
            stuck = {job for job in held - queued - live
                     if client.hget(f"rq:job:{job}", "status") == b"queued"}
            now = time.monotonic()
            self.held_since = {job: self.held_since.get(job, now) for job in stuck}
            due = [job for job, since in self.held_since.items()
                   if now - since >= STUCK_SECONDS]
            if not due:
                return
            queue = Queue(QUEUE, connection=client)
            # Not a worker of the run (no `chaos-` key, no pid): RQ's maintenance only.
            maintenance = SimpleWorker([queue], connection=client, name="rq-maintenance")
            entries = [e.decode() for e in client.zrange(registry, 0, -1)]
            for job_id in due:
                job = queue.fetch_job(job_id)
                if job is not None:
                    maintenance.handle_job_failure(
                        job, queue, exc_string="Job was stuck in intermediate queue.")
                for entry in entries:  # its dead worker's expired entry, if it made one
                    if entry.split(":", 1)[0] == job_id:
                        client.zrem(registry, entry)
                queue.intermediate_queue.remove(job_id)
                del self.held_since[job_id]

        self._redis(handle)

    def used_of(self, marker_attempt: int) -> int:
        return marker_attempt  # budget - retries_left: the running attempt counted

    def states(self, db: Database, specs: Mapping[str, JobSpec]) -> dict[str, JobState]:
        def read(client: Any) -> list[Any]:
            with client.pipeline(transaction=False) as pipe:
                for job in specs:
                    pipe.hmget(f"rq:job:{job}", "status", "retries_left", "ended_at")
                return list(pipe.execute())

        mapped = {"queued": "queued", "deferred": "queued", "scheduled": "queued",
                  "started": "running", "finished": "completed", "failed": "failed",
                  "stopped": "failed", "canceled": "failed"}
        states = {}
        for (job, spec), (status, left, ended) in zip(specs.items(), self._redis(read),
                                                      strict=True):
            if status is None:  # not enqueued yet
                states[job] = JobState("queued", 0, spec.max_attempts)
                continue
            state = mapped.get(status.decode(), status.decode())
            done = None
            if state == "completed" and ended:
                done = datetime.strptime(ended.decode(), "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                    tzinfo=UTC).timestamp()
            used = spec.max_attempts - (int(left) if left else 0)
            states[job] = JobState(state, used, spec.max_attempts, done)
        return states

    def whereabouts(self, db: Database, jobs: Sequence[str]) -> dict[str, str]:
        """``<status>/queued <n>/intermediate <n>/started <n>`` for each job: its hash's
        status, its copies on the queue, on RQ's intermediate queue (taken by a worker,
        not started yet) and in the started registry."""
        def read(client: Any) -> dict[str, str]:
            queued, held, started = self._copies(client)
            out = {}
            for job in jobs:
                status = client.hget(f"rq:job:{job}", "status")
                out[job] = (f"{status.decode() if status else 'no_job'}/queued "
                            f"{queued.count(job)}/intermediate {held.count(job)}/started "
                            f"{started.count(job)}")
            return out

        with contextlib.suppress(Exception):  # a report's extra: never the run's failure
            return self._redis(read)
        return {}

    def vanished(self, db: Database, jobs: Sequence[str]) -> set[str]:
        """Jobs RQ holds only on its intermediate queue: a worker moved each there as it
        dequeued it and died before starting it, so no started entry exists for any
        reconciler to see; only RQ's own maintenance, a minute after first seeing it
        there, fails it ("stuck in intermediate queue")."""
        queued, held, started = self._redis(self._copies)
        return {job for job in jobs if job in held and job not in queued
                and job not in started}

    def _copies(self, client: Any) -> tuple[list[str], list[str], list[str]]:
        """The job ids on the queue, on its intermediate queue and in its started
        registry."""
        queued = [j.decode() for j in client.lrange(f"rq:queue:{QUEUE}", 0, -1)]
        held = [j.decode() for j in client.lrange(f"rq:queue:{QUEUE}:intermediate", 0, -1)]
        started = [e.decode().split(":", 1)[0]
                   for e in client.zrange(f"rq:wip:{QUEUE}", 0, -1)]
        return queued, held, started
