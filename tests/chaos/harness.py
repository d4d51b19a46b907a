"""The chaos harness: real worker and reconciler processes, killed at random, then checked.

One run:

1. its own database: a SQLite file, or its own throwaway PostgreSQL or MariaDB server (so
   it can restart it), migrated with ``reconciler.storage.schema.upgrade``;
2. a fault phase of ``seconds``: jobs are enqueued at a steady pace; ``workers`` worker
   processes (tests/chaos/chaos_worker.py, the real ``Worker``) and ``replicas``
   ``reconciler run`` processes run them. Processes are started with a failpoint (worker
   points in turn, so kills spread over every point; replicas get the pass points) or
   none, and the killer SIGKILLs random workers and replicas until ``kills`` deaths;
   every dead process is restarted, often under its old name (session replacement). On
   PostgreSQL the server is restarted (``pg_ctl restart -m immediate``) ``db_restarts``
   times, on MariaDB killed (SIGKILL) and started again on its data. On SQLite, deaths
   land inside write transactions (the pass failpoints sit inside its transaction; the
   killer strikes wherever a process is);
3. a drain phase without faults: everything left is SIGKILLed, plain workers (under the
   old names) and one replica run until every job is terminal or ``drain_seconds`` pass;
4. the checks (tests/chaos/checks.py) over the database and the ledger.

Children are started from the calling thread only and die with the harness (see
tests/chaos/lifeline.py and tests/fork_server.py, which also removes the run's folder if the
harness is killed); everything started is killed and reaped before ``run`` returns.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import signal
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import ReconcilerLease
from reconciler import failpoints
from reconciler.storage.engines import create_engine
from reconciler.storage.schema import upgrade
from reconciler.worker import JobClient
from tests.chaos import chaos_worker
from tests.chaos.checks import TERMINAL, CheckReport, jobs_table, run_checks
from tests.chaos.lifeline import PARENT_ENV
from tests.coverage_scope import unmeasured
from tests.fork_server import ForkServer
from tests.mariadb_server import ThrowawayMariaDB
from tests.pg_server import ThrowawayPostgres
from tests.progress import Progress

REPO_ROOT = Path(__file__).resolve().parents[2]
leases_table = cast(sa.Table, ReconcilerLease.__table__)
LEADER_LEASE_NAME = "reconciler"  # the chores' leader lease, as the service names it

ENGINES = ("sqlite", "postgresql", "mariadb")
PASS_FAILPOINTS = ("between_decide_and_apply", "between_apply_and_record")
WORKER_FAILPOINTS = tuple(p for p in failpoints.POINTS if p not in PASS_FAILPOINTS)
STEP_FAILPOINTS = ("before_step_start", "after_step_start", "after_step_effect")
# Every worker point, plus the step points qualified by effect kind (a kill mid effectful
# step and one mid idempotent step lead to different decisions).
WORKER_FAILPOINT_CYCLE = WORKER_FAILPOINTS + tuple(
    f"{point}:{kind}" for point in STEP_FAILPOINTS for kind in ("effectful", "idempotent",
                                                                "pure"))

REPLICA_SETTINGS = {
    "interval_seconds": 0.3,
    "stale_after_seconds": 0.5,
    "wedged_after_seconds": 20.0,
    "leader_lease_seconds": 1.5,
    "batch_size": 200,
    "session_timeout_seconds": chaos_worker.SESSION_TIMEOUT_SECONDS,
    "session_heartbeat_seconds": chaos_worker.SESSION_HEARTBEAT_SECONDS,
    "metrics_port": 0,
}
ARM_WORKER_CHANCE = 0.75
ARM_REPLICA_CHANCE = 0.6
KILL_REPLICA_SHARE = 0.2  # of the killer's kills
KILL_OVERTIME_SHARE = 2.0  # of ``seconds``: how long the fault phase may run on for its kills
# A replica kill strikes the leader this often (always while a replica armed with a pass
# failpoint waits), so leadership moves and armed replicas get to lead.
KILL_LEADER_CHANCE = 0.7
SAME_NAME_CHANCE = 0.5
RESPAWN_DELAY_SECONDS = (0.05, 0.4)
ENQUEUE_SHARE_OF_FAULT_PHASE = 0.6
KILLS_DONE_BY_SHARE = 0.9
ENQUEUE_BATCH = 200
TICK_SECONDS = 0.05
STATUS_EVERY_SECONDS = 1.0
STOP_TIMEOUT_SECONDS = 15.0
MAX_ATTEMPTS_RANGE = (3, 6)
# Well above crash_loop_after: a poison job must end crash_loop, not run out of attempts.
POISON_MAX_ATTEMPTS = 6
# The poison is enqueued once the fleet is warm: in the first seconds a loaded machine
# loses leases to late heartbeats, and a poison job quarantined by those losses before its
# step ever ran would leave the containment check with nothing to check.
POISON_AT_SHARE = 0.15


@dataclass(frozen=True)
class ChaosParams:
    """What one run does; the defaults are a quick run."""

    engine: str = "sqlite"
    jobs: int = 300
    kills: int = 40
    replicas: int = 2
    db_restarts: int = 0
    seconds: float = 60.0
    workers: int = 4
    concurrency: int = 4
    drain_seconds: float = 120.0
    seed: int | None = None
    keep: bool = False
    poison: int = 2
    """Jobs whose step SIGKILLs every worker that runs it, enqueued at the start."""
    interval_seconds: float = REPLICA_SETTINGS["interval_seconds"]
    """The replicas' pass interval."""
    progress: bool = False
    """Print what the run is doing at least every 10 s (the full runs; CI's stay quiet)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError("engine must be sqlite, postgresql or mariadb")
        if self.db_restarts and self.engine == "sqlite":
            raise ValueError("--db-restarts needs --engine postgresql or mariadb")
        if min(self.jobs, self.workers, self.concurrency, self.replicas) < 1:
            raise ValueError("jobs, workers, concurrency and replicas must be at least 1")
        if self.kills < 0 or self.db_restarts < 0 or self.seconds <= 0 or self.poison < 0:
            raise ValueError("kills, db_restarts and poison must be >= 0, seconds > 0")
        if self.interval_seconds <= 0:
            raise ValueError("interval_seconds must be > 0")


@dataclass
class Child:
    """One process the harness started (through the fork server)."""

    role: str
    slot: int
    name: str
    failpoint: str | None
    pid: int
    killed_by_harness: bool = False
    stopping: bool = False  # stopped at a phase's end: not a kill of the run


@dataclass
class RunStats:
    """What the faults did, for the report."""

    kills_by_failpoint: Counter[str] = field(default_factory=Counter)
    killer_kills: Counter[str] = field(default_factory=Counter)
    unexpected_exits: Counter[str] = field(default_factory=Counter)
    poison_deaths: int = 0
    processes_started: Counter[str] = field(default_factory=Counter)
    db_restarts: int = 0
    drain_start_kills: int = 0
    unfinished_at_drain: int = 0
    jobs_enqueued: int = 0
    fault_seconds: float = 0.0
    drain_seconds: float = 0.0
    drained: bool = False

    @property
    def kills(self) -> int:
        return sum(self.kills_by_failpoint.values()) + sum(self.killer_kills.values())


@dataclass
class ChaosResult:
    """A run's parameters, what its faults did, and the checks' verdict."""

    params: ChaosParams
    seed: int
    stats: RunStats
    checks: CheckReport
    workdir: Path | None

    @property
    def ok(self) -> bool:
        """Every count is 0 (a drain that timed out leaves lost jobs, so it is not)."""
        return self.checks.ok

    def as_json(self) -> dict[str, Any]:
        """One JSON object: counts first, then parameters and what happened."""
        s = self.stats
        return {
            "ok": self.checks.ok,
            "counts": self.checks.counts,
            "parameters": {**{k: v for k, v in asdict(self.params).items()
                              if k != "progress"}, "seed": self.seed},
            "kills": {
                "total": s.kills,
                "by_failpoint": dict(sorted(s.kills_by_failpoint.items())),
                "by_killer": dict(sorted(s.killer_kills.items())),
            },
            "db_restarts": s.db_restarts,
            "processes_started": dict(s.processes_started),
            "unexpected_exits": dict(sorted(s.unexpected_exits.items())),
            "poison_deaths": s.poison_deaths,
            "jobs_enqueued": s.jobs_enqueued,
            "drained": s.drained,
            "unfinished_at_drain": s.unfinished_at_drain,
            "seconds": {"fault_phase": round(s.fault_seconds, 1),
                        "drain_phase": round(s.drain_seconds, 1)},
            "violations_by_rule": self.checks.by_rule,
            "examples": [
                {"job_id": v.job_id, "check": v.check, "rule": v.rule, "detail": v.detail}
                for v in self.checks.examples()
            ],
            "facts": self.checks.facts,
            "workdir": str(self.workdir) if self.workdir else None,
        }

    def render(self) -> str:
        """The human report."""
        s, p, f = self.stats, self.params, self.checks.facts
        lines = [
            f"chaos run: engine={p.engine} jobs={p.jobs} kills={p.kills} "
            f"replicas={p.replicas} db_restarts={p.db_restarts} seconds={p.seconds:g} "
            f"workers={p.workers}x{p.concurrency} seed={self.seed}",
            f"fault phase {s.fault_seconds:.1f}s, drain {s.drain_seconds:.1f}s for "
            f"{s.unfinished_at_drain} unfinished jobs "
            f"({'all jobs terminal' if s.drained else 'DRAIN TIMED OUT'})",
            f"kills: {s.kills} (failpoints {sum(s.kills_by_failpoint.values())}, killer "
            f"{sum(s.killer_kills.values())}); database restarts: {s.db_restarts}",
            "  by failpoint: " + ", ".join(
                f"{k}={v}" for k, v in sorted(s.kills_by_failpoint.items())),
            "  by killer: " + ", ".join(f"{k}={v}" for k, v in sorted(s.killer_kills.items())),
            f"processes started: {dict(s.processes_started)}; unexpected exits: "
            f"{dict(sorted(s.unexpected_exits.items())) or 0}; workers killed by the "
            f"{p.poison} poison jobs: {f['poison_runs']}",
            f"jobs: {f['jobs']} {f['jobs_by_final_state']}",
            f"claims: {f['claims']} {f['attempts_by_outcome']}",
            f"decisions applied: {f['decisions_applied']}; all decisions (skips too) by "
            f"reason {f['decisions_by_reason']}",
            f"effects done: {f['effects_done']} (reruns of any kind: "
            f"{f['effects_rerun_any_kind']}); fenced writes refused: "
            f"{f['fenced_writes_refused']}",
            self.checks.render(),
            "OK: every count is 0" if self.checks.ok else "FAILED: some count is not 0",
        ]
        if self.workdir:
            lines.append(f"kept: {self.workdir}")
        return "\n".join(lines)


class Harness:
    """Runs one chaos run; use ``run()``. Everything it starts is gone when it returns."""

    def __init__(self, params: ChaosParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else random.randrange(2**31)
        self.rng = random.Random(self.seed)
        self.stats = RunStats()
        self.children: dict[int, Child] = {}  # live children by pid
        self.forks: ForkServer | None = None
        self.respawns: list[tuple[float, str, int]] = []
        self.workdir = Path(tempfile.mkdtemp(prefix="reconciler-chaos-"))
        self.ledger_dir = self.workdir / "ledger"
        self.ledger_dir.mkdir()
        (self.workdir / "logs").mkdir()
        self.pg: ThrowawayPostgres | None = None
        self.mariadb: ThrowawayMariaDB | None = None
        self.url = ""
        self.engine: Engine | None = None
        self.client: JobClient | None = None
        self.faults_on = True
        self.worker_cycle = itertools.cycle(WORKER_FAILPOINT_CYCLE)
        self.replica_cycle = itertools.cycle(PASS_FAILPOINTS)
        self.incarnations = itertools.count(1)
        self.max_attempts = [self.rng.randint(*MAX_ATTEMPTS_RANGE) for _ in range(params.jobs)]
        self.progress = Progress("chaos", enabled=params.progress)
        self.last_unfinished = params.jobs

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> ChaosResult:
        try:
            with self.progress:
                self.progress.phase(f"opening a {self.params.engine} database (seed {self.seed})")
                self._open_database()
                # Unmeasured (tests/coverage_scope.py): its children end by SIGKILL or
                # os._exit, so what coverage traced in them is never saved.
                self.forks = ForkServer(
                    cwd=str(REPO_ROOT), env=unmeasured(self._base_env(os.getpid())),
                    log=str(self.workdir / "logs" / "fork-server.log"),
                    cleanup=None if self.params.keep else str(self.workdir))
                self._fault_phase()
                self._drain_phase()
                assert self.engine is not None
                self.progress.phase(f"checking invariants over {self.params.jobs} jobs")
                report = run_checks(self.engine, self.ledger_dir)
        finally:
            if self.forks is not None:
                self._stop_children(signal.SIGKILL, count_as_drain_kills=False)
                self.forks.close()
            self._close()
        return ChaosResult(self.params, self.seed, self.stats, report,
                           self.workdir if self.params.keep else None)

    def _open_database(self) -> None:
        if self.params.engine == "postgresql":
            self.pg = ThrowawayPostgres(max_connections=400).start()
            self.pg.create_database("chaos")
            self.url = self.pg.url("chaos")
        elif self.params.engine == "mariadb":
            self.mariadb = ThrowawayMariaDB().start()
            self.mariadb.create_database("chaos")
            self.url = self.mariadb.url("chaos")
        else:
            self.url = f"sqlite:///{self.workdir / 'chaos.db'}"
        self.engine = create_engine(self.url)
        upgrade(self.engine)
        self.client = JobClient(self.engine)

    def _close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.engine is not None:
            self.engine.dispose()
        if self.pg is not None:
            self.pg.stop()
        if self.mariadb is not None:
            self.mariadb.stop()
        if not self.params.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- phases ----------------------------------------------------------------------------

    def _fault_phase(self) -> None:
        p = self.params
        started = time.monotonic()
        end = started + p.seconds
        restarts = sorted(started + p.seconds * (k + self.rng.uniform(0.25, 0.75)) / p.db_restarts
                          for k in range(p.db_restarts)) if p.db_restarts else []
        for slot in range(p.replicas):
            self._spawn("replica", slot, same_name=True)
        for slot in range(p.workers):
            self._spawn("worker", slot, same_name=True)
        poison_at: float | None = started + p.seconds * POISON_AT_SHARE
        self.progress.phase(f"fault phase ({p.seconds:g}s)", total=round(p.seconds),
                            detail=self._status_counts)
        next_status = started
        # A loaded machine runs the workers slower, so they reach their failpoints less
        # often: the phase runs on past ``seconds`` until the kills are done, within bounds.
        overtime_end = end + p.seconds * KILL_OVERTIME_SHARE
        while (now := time.monotonic()) < end or (
                now < overtime_end and self.stats.kills < p.kills):
            elapsed = now - started
            self.progress.advance(round(elapsed))
            self._enqueue_due(elapsed)
            if poison_at is not None and now >= poison_at and self._enqueue_poison():
                poison_at = None
            self._reap()
            self._respawn_due(now)
            if restarts and now >= restarts[0]:
                restarts.pop(0)
                self._restart_database()
            self._kill_due(elapsed)
            if now >= next_status:
                next_status = now + STATUS_EVERY_SECONDS
                unfinished = self._unfinished()  # also what progress lines show
                if (self.stats.jobs_enqueued == p.jobs and self.stats.kills >= p.kills
                        and not restarts and poison_at is None and unfinished == 0
                        and not self._owed_roles()):
                    break
            time.sleep(TICK_SECONDS)
        self.stats.fault_seconds = time.monotonic() - started

    def _drain_phase(self) -> None:
        p = self.params
        started = time.monotonic()
        self.faults_on = False
        self._enqueue_due(float("inf"))
        self.stats.unfinished_at_drain = self._unfinished()
        self._stop_children(signal.SIGKILL, count_as_drain_kills=True)
        self.respawns.clear()
        self._spawn("replica", 0, same_name=True)
        for slot in range(p.workers):
            self._spawn("worker", slot, same_name=True)
        deadline = started + p.drain_seconds
        self.progress.phase(f"drain (at most {p.drain_seconds:g}s, no faults)", total=p.jobs,
                            detail=self._status_counts)
        while time.monotonic() < deadline:
            self._enqueue_due(float("inf"))
            self._reap()
            self._respawn_due(time.monotonic())
            unfinished = self._unfinished()
            if unfinished >= 0:
                self.progress.advance(p.jobs - unfinished)
            if self.stats.jobs_enqueued == p.jobs and unfinished == 0:
                self.stats.drained = True
                break
            time.sleep(STATUS_EVERY_SECONDS / 4)
        self._stop_children(signal.SIGTERM, count_as_drain_kills=False)
        self.stats.drain_seconds = time.monotonic() - started

    # -- jobs ------------------------------------------------------------------------------

    def _enqueue_due(self, elapsed: float) -> None:
        p = self.params
        window = max(p.seconds * ENQUEUE_SHARE_OF_FAULT_PHASE, 1.0)
        due = min(p.jobs, int(p.jobs * min(elapsed / window, 1.0)) + 1)
        assert self.client is not None
        assert self.engine is not None
        while self.stats.jobs_enqueued < due:
            first = self.stats.jobs_enqueued
            last = min(due, first + ENQUEUE_BATCH)
            try:
                with self.engine.begin() as conn:
                    for n in range(first, last):
                        self.client.enqueue(
                            chaos_worker.JOB_KIND, chaos_worker.PLANS[n % len(chaos_worker.PLANS)],
                            idempotency_key=f"chaos-{n}", max_attempts=self.max_attempts[n],
                            payload={"n": n}, connection=conn)
            except sa.exc.DBAPIError:
                return  # the database is restarting; the same keys are tried again later
            self.stats.jobs_enqueued = last

    def _enqueue_poison(self) -> bool:
        """Enqueue the poison jobs; False while the database is restarting (tried again)."""
        assert self.client is not None
        try:
            for n in range(self.params.poison):
                self.client.enqueue(chaos_worker.POISON_KIND, chaos_worker.POISON_PLAN,
                                    idempotency_key=f"chaos-poison-{n}",
                                    max_attempts=POISON_MAX_ATTEMPTS)
        except sa.exc.DBAPIError:
            return False  # the idempotency keys make the next try enqueue each job once
        return True

    def _unfinished(self) -> int:
        assert self.engine is not None
        try:
            with self.engine.connect() as conn:
                self.last_unfinished = int(conn.execute(
                    sa.select(sa.func.count()).select_from(jobs_table)
                    .where(jobs_table.c.job_status.not_in(sorted(TERMINAL)))
                ).scalar_one())
                return self.last_unfinished
        except sa.exc.DBAPIError:
            return -1

    def _status_counts(self) -> str:
        """Counters for a progress line, from what the harness already knows (no query)."""
        s, p = self.stats, self.params
        return (f"jobs {s.jobs_enqueued}/{p.jobs}, kills {s.kills}/{p.kills}, "
                f"db restarts {s.db_restarts}/{p.db_restarts}, "
                f"unfinished {self.last_unfinished}, "
                f"unexpected exits {sum(s.unexpected_exits.values())}")

    # -- processes -------------------------------------------------------------------------

    def _armed_alive(self) -> int:
        return sum(1 for c in self.children.values() if c.failpoint)

    def _choose_failpoint(self, role: str) -> str | None:
        if not self.faults_on or self.stats.kills + self._armed_alive() >= self.params.kills:
            return None
        if role == "worker":
            return next(self.worker_cycle) if self.rng.random() < ARM_WORKER_CHANCE else None
        unarmed = sum(1 for c in self.children.values()
                      if c.role == "replica" and not c.failpoint)
        if (unarmed or self.params.replicas == 1) and self.rng.random() < ARM_REPLICA_CHANCE:
            return next(self.replica_cycle)
        return None

    def _base_env(self, parent_pid: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("RECONCILER_") or k == "RECONCILER_PG_BIN"}
        env[PARENT_ENV] = str(parent_pid)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                          os.environ.get("PYTHONPATH")]))
        return env

    def _spawn(self, role: str, slot: int, *, same_name: bool) -> None:
        assert self.forks is not None
        base = f"w{slot}" if role == "worker" else f"replica-{slot}"
        name = base if same_name else f"{base}-{next(self.incarnations)}"
        failpoint = self._choose_failpoint(role)
        env = self._base_env(self.forks.pid)
        if failpoint:
            env[failpoints.ENV] = failpoint
        if role == "worker":
            module = "tests.chaos.chaos_worker"
            args = [self.url, name, str(self.ledger_dir), str(self.rng.randrange(2**31)),
                    str(self.params.concurrency)]
        else:
            module, args = "tests.chaos.chaos_replica", []
            settings = {**REPLICA_SETTINGS, "interval_seconds": self.params.interval_seconds}
            env.update({f"RECONCILER_{k.upper()}": str(v) for k, v in settings.items()})
            env["RECONCILER_DATABASE_URL"] = self.url
            env["RECONCILER_INSTANCE_NAME"] = name
            env["RECONCILER_ARTIFACT_ROOT"] = str(self.workdir / "artifacts")
        log = str(self.workdir / "logs" / f"{role}s.log")
        pid = self.forks.spawn(module, args, env, log)
        self.children[pid] = Child(role, slot, name, failpoint, pid)
        self.stats.processes_started[role] += 1

    def _reap(self, timeout: float = 0.0) -> None:
        assert self.forks is not None
        for pid, code in self.forks.exits(timeout):
            child = self.children.pop(pid, None)
            if child is None or child.stopping:
                continue
            if code == -signal.SIGKILL and child.killed_by_harness:
                self.stats.killer_kills[child.role] += 1
            elif code == -signal.SIGKILL and child.failpoint:
                self.stats.kills_by_failpoint[child.failpoint] += 1
            elif code == -signal.SIGKILL and child.role == "worker":
                self.stats.poison_deaths += 1  # nothing else SIGKILLs an unarmed worker
                # (an armed one killed by poison is counted under its failpoint)
            elif not child.killed_by_harness:
                self.stats.unexpected_exits[f"{child.role}:exit_{code}"] += 1
            delay = self.rng.uniform(*RESPAWN_DELAY_SECONDS)
            self.respawns.append((time.monotonic() + delay, child.role, child.slot))

    def _respawn_due(self, now: float) -> None:
        due = [r for r in self.respawns if r[0] <= now]
        self.respawns = [r for r in self.respawns if r[0] > now]
        for _, role, slot in due:
            self._spawn(role, slot, same_name=self.rng.random() < SAME_NAME_CHANCE)

    def _signal(self, child: Child, sig: signal.Signals, *, stopping: bool = False) -> None:
        assert self.forks is not None
        child.killed_by_harness = True
        child.stopping = child.stopping or stopping
        self.forks.kill(child.pid, sig)

    def _owed_roles(self) -> list[str]:
        """The roles the killer has not struck yet in this run (a strike counts once its
        process is reaped; one on its way counts already)."""
        striking = {c.role for c in self.children.values()
                    if c.killed_by_harness and not c.stopping}
        return [r for r in ("replica", "worker")
                if self.stats.killer_kills[r] == 0 and r not in striking]

    def _kill_due(self, elapsed: float) -> None:
        p = self.params
        if not self.faults_on:
            return
        share = elapsed / (p.seconds * KILLS_DONE_BY_SHARE)
        late = share >= 1.0
        killed = self.stats.killer_kills
        # A role the killer has not struck yet: where failpoints alone reached the run's
        # kills (fast workers reach them sooner), late in the phase it strikes it anyway,
        # so every run kills workers and replicas at random too.
        owed = self._owed_roles() if late else []
        if self.stats.kills >= p.kills and not owed:
            return
        # Until late in the phase, armed processes count as kills on their way.
        expected = self.stats.kills + (0 if late else self._armed_alive() / 2)
        if expected >= p.kills * min(share, 1.0) and not owed:
            return
        # Armed processes die at their failpoints; the killer strikes the others, and
        # late in the phase any process, so the run reaches its kills.
        alive = [c for c in self.children.values()
                 if not c.killed_by_harness and (late or not c.failpoint)]
        role = owed[0] if owed else (
            "replica" if killed["replica"] < KILL_REPLICA_SHARE * (killed.total() + 1)
            else "worker")
        pool = [c for c in alive if c.role == role]
        armed_replica = any(c.role == "replica" and c.failpoint for c in self.children.values())
        if role == "replica" and (armed_replica or self.rng.random() < KILL_LEADER_CHANCE):
            leader = self._leader()
            pool = [c for c in pool if c.name == leader] or pool
        if pool:
            self._signal(self.rng.choice(pool), signal.SIGKILL)

    def _leader(self) -> str | None:
        assert self.engine is not None
        try:
            with self.engine.connect() as conn:
                # The brake keeps a lease row of its own beside the chores' leader lease.
                return conn.execute(sa.select(leases_table.c.holder_id).where(
                    leases_table.c.lease_name == LEADER_LEASE_NAME)).scalar_one_or_none()
        except sa.exc.DBAPIError:
            return None

    def _restart_database(self) -> None:
        if self.mariadb is not None:
            self.mariadb.restart()
        else:
            assert self.pg is not None
            self.pg.restart(mode="immediate")
        self.stats.db_restarts += 1

    def _stop_children(self, sig: signal.Signals, *, count_as_drain_kills: bool) -> None:
        """Signal every live child, wait for all to end (SIGKILL after a grace), reap."""
        for child in list(self.children.values()):
            self._signal(child, sig, stopping=True)
            if count_as_drain_kills:
                self.stats.drain_start_kills += 1
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        while self.children and time.monotonic() < deadline:
            self._reap(timeout=0.1)
        for child in list(self.children.values()):
            self._signal(child, signal.SIGKILL, stopping=True)
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        while self.children and time.monotonic() < deadline:
            self._reap(timeout=0.1)
        self.respawns.clear()


def run_chaos(params: ChaosParams) -> ChaosResult:
    """Run one chaos run and check it."""
    return Harness(params).run()
