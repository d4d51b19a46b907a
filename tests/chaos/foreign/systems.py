"""One adapter per real job system: how the chaos run sets it up, enqueues, starts a worker
and reads its jobs. Adding a system is one more class here (the Python ones whose workers
are Django's ``db_worker`` and ``celery worker``: python_systems.py; RQ and Dramatiq,
whose store is Redis: rq_system.py, dramatiq_system.py).

Every adapter enqueues through the system's own functions (Procrastinate's
``procrastinate_defer_jobs_v1``, graphile-worker's ``add_job``, pg-boss's ``createQueue``
and ``send``), each job delayed so the jobs become runnable spread over the fault phase,
and reads job state from the system's own columns, mapped onto ``queued`` | ``running`` |
``completed`` | ``failed``. A task writes ``<job>-started-<attempt>`` and
``<job>-done-<attempt>`` markers in the system's own attempt numbering; ``used_of`` turns a
marker's attempt into "attempts used" as the reconciler's evidence counts them.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psycopg

from tests.chaos.foreign.database import Database
from tests.sources.conftest import (
    GRAPHILE_WORKER_VERSION,
    NODE_DIR,
    NODE_HINT,
    PG_BOSS_VERSION,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
KINDS = ("idem.work", "pure.work", "effect.work")
TERMINAL = ("completed", "failed")


class UnavailableError(RuntimeError):
    """What a system needs is not on this machine (node, npm, Procrastinate)."""


@dataclass(frozen=True)
class JobSpec:
    """One job to enqueue: its kind, budget, per-attempt hang (seconds), and delay."""

    kind: str
    max_attempts: int
    hang: tuple[float, ...]
    delay_seconds: float


@dataclass(frozen=True)
class JobState:
    """A job as its system records it."""

    status: str
    attempts_used: int | None
    max_attempts: int | None
    completed_at: float | None = None
    """Epoch seconds of the completion the system recorded, where it records one."""


class System(Protocol):
    """What a chaos run needs of one job system."""

    name: str
    """The ``[source] kind``."""
    reclaim_after_seconds: float
    """How long a dead owner's job waits before the reconciler may act."""
    completion_fenced: bool
    """The system's completion matches only a job still running (a late one on an ended
    job is refused), rather than any row with the id."""

    def prepare(self, db: Database) -> None:
        """Install the system's schema (and tools) into the run's database."""

    def source_table(self) -> dict[str, str]:
        """The config file's ``[source]`` keys besides ``kind``."""

    def settings(self) -> dict[str, float]:
        """Top-level settings this system needs (a session timeout)."""

    def kind_rule(self) -> dict[str, float]:
        """Keys of ``[kinds."*"]`` (a max run time, a budget the system does not keep)."""

    def enqueue(self, db: Database, jobs: Sequence[JobSpec]) -> list[str]:
        """Enqueue the jobs through the system's own functions; their ids, in order."""

    def worker_command(self, db: Database, markers: Path, slot: int = 0
                       ) -> tuple[list[str], dict[str, str]]:
        """argv and environment of one real worker process."""

    def used_of(self, marker_attempt: int) -> int:
        """Attempts used (the running one included) by the attempt a marker names."""

    def states(self, db: Database, specs: Mapping[str, JobSpec]) -> dict[str, JobState]:
        """Every enqueued job's state, by id."""

    def kind_pattern(self, pattern: str) -> str:
        """The ``[kinds]`` pattern matching the jobs ``pattern`` names (``idem.*``) as the
        system spells their kinds."""

    def whereabouts(self, db: Database, jobs: Sequence[str]) -> dict[str, str]:
        """Where each of these unfinished jobs is, in the system's words (its row, its
        broker's copies): for the report; empty where the job table says it all."""

    def vanished(self, db: Database, jobs: Sequence[str]) -> set[str]:
        """Of these unfinished jobs, those the system holds no copy of any more to run (a
        broker's message neither queued nor held unacknowledged, once the run published
        it): none for a system whose jobs live in its tables."""

    def close(self) -> None:
        """Stop what ``prepare`` started besides the database (a broker)."""

    def restart_store(self) -> bool:
        """Restart the system's own store (RQ's Redis) as the run's one restart; False:
        the system lives in PostgreSQL, which the run restarts."""

    def age(self, pid: int) -> None:
        """The dead (or long-stopped) worker ``pid``'s claims as the system's own clock
        leaves them once their expiry has passed, where that expiry is longer than a run
        can wait (RQ's minute: rq_system.py); nothing for the others."""

    def maintain(self) -> None:
        """During the drain, the system's own periodic maintenance that a live fleet runs
        beside its workers, where it is what ends a dead worker's job and its interval is
        longer than a run can wait (RQ's intermediate queue: rq_system.py); nothing for
        the others."""


class SystemBase:
    """Kinds spelt as enqueued (``idem.work``), nothing to stop at the end, PostgreSQL the
    store the run restarts, no expiry to compress."""

    def kind_pattern(self, pattern: str) -> str:
        return pattern

    def whereabouts(self, db: Database, jobs: Sequence[str]) -> dict[str, str]:
        return {}

    def vanished(self, db: Database, jobs: Sequence[str]) -> set[str]:
        return set()

    def close(self) -> None:
        return None

    def restart_store(self) -> bool:
        return False

    def age(self, pid: int) -> None:
        return None

    def maintain(self) -> None:
        return None


class Procrastinate(SystemBase):
    """Procrastinate 3.x: python workers heartbeating every 0.3 s (procrastinate_app.py)."""

    name = "procrastinate"
    schema = "procrastinate"
    completion_fenced = True  # procrastinate_finish_job: status todo or doing

    def __init__(self, session_timeout_seconds: float = 3.0, max_attempts: int = 4) -> None:
        self.reclaim_after_seconds = session_timeout_seconds
        self.max_attempts = max_attempts

    def prepare(self, db: Database) -> None:
        try:
            from procrastinate.schema import SchemaManager  # noqa: PLC0415 - optional (peers)
        except ImportError as exc:
            raise UnavailableError(
                "Procrastinate is not installed: pip install -e '.[peers]'") from exc
        with psycopg.connect(db.libpq, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {self.schema}")
            conn.execute(f"SET search_path TO {self.schema}")
            conn.execute(SchemaManager.get_schema())

    def source_table(self) -> dict[str, str]:
        return {"schema": self.schema}

    def settings(self) -> dict[str, float]:
        return {"session_timeout_seconds": self.reclaim_after_seconds}

    def kind_rule(self) -> dict[str, float]:
        # Procrastinate keeps no budget in its tables: ours is the [kinds] one.
        return {"max_attempts": self.max_attempts}

    def enqueue(self, db: Database, jobs: Sequence[JobSpec]) -> list[str]:
        rows = db.query(
            "SELECT unnest(procrastinate.procrastinate_defer_jobs_v1(array_agg(ROW('chaos', "
            "j.task, 0, NULL, NULL, j.args, now() + make_interval(secs => j.delay))"
            "::procrastinate.procrastinate_job_to_defer_v1 ORDER BY j.n))) "
            "FROM jsonb_to_recordset(%(jobs)s::jsonb) "
            "AS j(n int, task text, args jsonb, delay float8)",
            {"jobs": json.dumps([{"n": n, "task": s.kind, "args": {"hang": list(s.hang)},
                                  "delay": s.delay_seconds} for n, s in enumerate(jobs)])},
            search_path=f"{self.schema},public")
        return [str(r[0]) for r in rows]

    def worker_command(self, db: Database, markers: Path, slot: int = 0
                       ) -> tuple[list[str], dict[str, str]]:
        return [sys.executable, "-m", "tests.sources.procrastinate_app"], {
            "SOURCES_PG_CONNINFO": db.conninfo(f"{self.schema},public"),
            "SOURCES_MARKERS": str(markers), "SOURCES_DATABASE_URL": db.url,
            "SOURCES_STALLED_SECONDS": str(self.reclaim_after_seconds)}

    def used_of(self, marker_attempt: int) -> int:
        return marker_attempt + 1  # ``attempts`` counts the attempts finished before

    def states(self, db: Database, specs: Mapping[str, JobSpec]) -> dict[str, JobState]:
        rows = db.query(
            "SELECT j.id::text, j.status::text, j.attempts, (SELECT extract(epoch FROM max(e.at)) "
            "FROM procrastinate.procrastinate_events e WHERE e.job_id = j.id "
            "AND e.type = 'succeeded') FROM procrastinate.procrastinate_jobs j")
        mapped = {"todo": "queued", "doing": "running", "succeeded": "completed",
                  "failed": "failed", "cancelled": "failed", "aborted": "failed"}
        return {job: JobState(mapped.get(status, status),
                              attempts + (1 if status == "doing" else 0), self.max_attempts,
                              None if done is None else float(done))
                for job, status, attempts, done in rows if job in specs}


class _NodeSystem(SystemBase):
    """A system whose workers are Node scripts of tests/sources/node, installed from npm."""

    script = ""
    name = ""
    completion_fenced = False

    def __init__(self, max_run_seconds: float) -> None:
        self.reclaim_after_seconds = max_run_seconds
        self.node_modules: Path | None = None

    def settings(self) -> dict[str, float]:
        return {}

    def kind_rule(self) -> dict[str, float]:
        # No liveness of its own: a dead worker's job waits out the kind's promise.
        return {"max_run_seconds": self.reclaim_after_seconds}

    def source_table(self) -> dict[str, str]:
        return {}

    def node(self, db: Database, markers: Path, *args: str,
             stdin: str | None = None) -> str:
        """Run the system's script to completion; its output."""
        argv, env = self.worker_command(db, markers)
        done = subprocess.run([*argv[:2], *args], input=stdin, capture_output=True,
                              text=True, timeout=180, env=env, cwd=REPO_ROOT, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"node {self.script} {args[0]} failed: "
                               f"{done.stderr.strip()[-800:]}")
        return done.stdout

    def worker_command(self, db: Database, markers: Path, slot: int = 0
                       ) -> tuple[list[str], dict[str, str]]:
        if self.node_modules is None:
            self.node_modules = install_node_modules()
        node = shutil.which("node")
        assert node is not None
        return [node, str(NODE_DIR / self.script), "worker", *self.worker_args()], {
            "NODE_PATH": str(self.node_modules), "SOURCES_PG_CONNINFO": db.libpq,
            "SOURCES_MARKERS": str(markers)}

    def worker_args(self) -> list[str]:
        return []

    def prepare(self, db: Database) -> None:
        self.node(db, Path(tempfile.gettempdir()), "migrate")


class GraphileWorker(_NodeSystem):
    """graphile-worker 0.17: completed jobs are deleted; ``attempts`` counts claims."""

    name = "graphile-worker"
    script = "graphile_worker_runner.js"
    completion_fenced = False  # DELETE by id

    def enqueue(self, db: Database, jobs: Sequence[JobSpec]) -> list[str]:
        rows = db.query(
            "SELECT (graphile_worker.add_job(j.task, json_build_object('hang', j.hang), "
            "run_at => now() + make_interval(secs => j.delay), max_attempts => j.budget)).id "
            "FROM jsonb_to_recordset(%(jobs)s::jsonb) "
            "AS j(n int, task text, hang json, delay float8, budget int) ORDER BY j.n",
            {"jobs": json.dumps([{"n": n, "task": s.kind, "hang": list(s.hang),
                                  "delay": s.delay_seconds, "budget": s.max_attempts}
                                 for n, s in enumerate(jobs)])})
        return [str(r[0]) for r in rows]

    def used_of(self, marker_attempt: int) -> int:
        return marker_attempt  # the claim counted it already

    def states(self, db: Database, specs: Mapping[str, JobSpec]) -> dict[str, JobState]:
        rows = {str(r[0]): r[1:] for r in db.query(
            "SELECT id, locked_at IS NOT NULL, attempts, max_attempts "
            "FROM graphile_worker._private_jobs")}
        states = {}
        for job, spec in specs.items():
            if job not in rows:  # graphile-worker deletes a job when it completes
                states[job] = JobState("completed", None, spec.max_attempts)
                continue
            locked, attempts, budget = rows[job]
            status = ("running" if locked else "failed" if attempts >= budget else "queued")
            states[job] = JobState(status, attempts, budget)
        return states


class PgBoss(_NodeSystem):
    """pg-boss 10: ``retry_count`` counts fetches after the first; maintenance is off."""

    name = "pg-boss"
    script = "pgboss_runner.js"
    completion_fenced = True  # state = 'active'

    def worker_args(self) -> list[str]:
        return list(KINDS)

    def enqueue(self, db: Database, jobs: Sequence[JobSpec]) -> list[str]:
        # pg-boss's own expiry far away: only the reconciler's lease is in play.
        payload = [{"name": s.kind, "data": {"hang": list(s.hang)},
                    "options": {"retryLimit": s.max_attempts - 1, "expireInSeconds": 3600,
                                "startAfter": max(1, round(s.delay_seconds))}}
                   for s in jobs]
        ids = json.loads(self.node(db, Path(tempfile.gettempdir()), "send",
                                   stdin=json.dumps(payload)))
        return [str(i) for i in ids]

    def used_of(self, marker_attempt: int) -> int:
        return marker_attempt + 1

    def states(self, db: Database, specs: Mapping[str, JobSpec]) -> dict[str, JobState]:
        rows = db.query("SELECT id::text, state::text, retry_count, retry_limit, "
                        "extract(epoch FROM completed_on) FROM pgboss.job")
        mapped = {"created": "queued", "retry": "queued", "active": "running",
                  "completed": "completed", "failed": "failed", "cancelled": "failed"}
        return {job: JobState(mapped.get(state, state), retries + 1, limit + 1,
                              None if done is None or state != "completed" else float(done))
                for job, state, retries, limit, done in rows if job in specs}


def install_node_modules() -> Path:
    """graphile-worker and pg-boss from npm, once, into the folder the source tests use."""
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        raise UnavailableError(NODE_HINT)
    folder = (Path(tempfile.gettempdir()) / "reconciler-test-npm" /
              f"graphile-worker-{GRAPHILE_WORKER_VERSION}-pg-boss-{PG_BOSS_VERSION}")
    folder.mkdir(parents=True, exist_ok=True)
    wanted = {"graphile-worker": GRAPHILE_WORKER_VERSION, "pg-boss": PG_BOSS_VERSION}

    def installed() -> bool:
        for package, version in wanted.items():
            manifest = folder / "node_modules" / package / "package.json"
            if not manifest.exists() or json.loads(manifest.read_text())["version"] != version:
                return False
        return True

    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # sessions side by side install once
        if not installed():
            (folder / "package.json").write_text(json.dumps({"private": True}))
            done = subprocess.run(
                [npm, "install", "--no-audit", "--no-fund", "--loglevel=error",
                 *(f"{p}@{v}" for p, v in wanted.items())],
                cwd=folder, capture_output=True, text=True, timeout=300, check=False)
            if done.returncode != 0 or not installed():
                raise RuntimeError(f"npm install failed: {done.stderr.strip()[-500:]}")
    return folder / "node_modules"


def make_system(name: str, *, hang_max_seconds: float) -> System:
    """The adapter for ``name``; systems without liveness get a max run time well above
    every hang."""
    from tests.chaos.foreign import python_systems  # noqa: PLC0415 - it imports this module

    max_run = round(3 * hang_max_seconds + 3, 1)
    if name == "procrastinate":
        return Procrastinate()
    if name == "django-tasks":
        return python_systems.DjangoTasks(max_run)
    if name == "celery":
        return python_systems.Celery(max_run)
    if name == "rq":
        from tests.chaos.foreign.rq_system import Rq  # noqa: PLC0415 - it imports this module

        return Rq()
    if name == "dramatiq":
        from tests.chaos.foreign.dramatiq_system import (  # noqa: PLC0415 - imports this
            Dramatiq,
        )

        return Dramatiq()
    return GraphileWorker(max_run) if name == "graphile-worker" else PgBoss(max_run)


SYSTEMS = ("procrastinate", "graphile-worker", "pg-boss", "django-tasks", "celery", "rq",
           "dramatiq")
