"""One chaos run with a real job system: its workers and two ``reconciler run`` replicas,
killed, stopped and restarted at random, PostgreSQL restarted once, then a drain and the
checks (checks.py).

1. Its own throwaway PostgreSQL; the reconciler's schema (``schema.upgrade``) and the
   system's in one database; a config file (``[source] kind``, ``[kinds]``: ``idem.*``
   idempotent, ``pure.*`` pure, ``effect.*`` effectful).
2. Jobs of the three kinds enqueued at the start through the system's own functions,
   each delayed so they become runnable over the first 60% of the fault phase, each
   attempt hanging a short random while.
3. Fault phase: ``workers`` real workers and ``replicas`` replicas (``reconciler run
   --config``). The killer SIGKILLs workers (mostly ones inside a task), SIGSTOPs workers
   inside a task for a random while and SIGCONTs them (the late writer), SIGKILLs
   replicas; every dead process is restarted after a moment. PostgreSQL is restarted once
   (``immediate``) mid-phase.
4. Drain: faults stop, stopped workers continue, plain workers and one replica run until
   every job is terminal or ``drain_seconds`` pass, then until no worker is inside a task
   (so every late writer has written).
"""

from __future__ import annotations

import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from reconciler.storage.engines import create_engine
from reconciler.storage.schema import upgrade
from tests.chaos.foreign.checks import Checks, FaultLog, run_checks
from tests.chaos.foreign.database import Database
from tests.chaos.foreign.processes import (
    NAME_TAKEN,
    Child,
    Children,
    exit_cause,
    mid_task,
    read_markers,
)
from tests.chaos.foreign.systems import KINDS, REPO_ROOT, TERMINAL, JobSpec, System, make_system
from tests.pg_server import ThrowawayPostgres

INTERVAL_SECONDS = 0.3
REPLICA_SETTINGS = {"stale_after_seconds": 0.5, "wedged_after_seconds": 3600.0,
                    "leader_lease_seconds": 1.5, "batch_size": 200, "metrics_port": 0,
                    # Killed workers' jobs go stale together on purpose: no brake.
                    "brake_hold_seconds": 0.0, "session_heartbeat_seconds": 0.3}
EFFECTS = (("idem.*", "idempotent"), ("pure.*", "pure"), ("effect.*", "effectful"))
MAX_ATTEMPTS_RANGE = (3, 5)
ENQUEUE_SHARE = 0.6
FAULTS_DONE_BY_SHARE = 0.85
REPLICA_KILL_SHARE = 0.15
MID_TASK_KILL_CHANCE = 0.8
RESPAWN_DELAY_SECONDS = (0.1, 0.5)
SUPERVISOR_RESTART_SECONDS = 1.5
"""How long a worker refused its fixed name waits before its next start (a supervisor's
restart delay, as systemd's ``RestartSec``)."""
TICK_SECONDS = 0.1
RETRY_FAULT_SECONDS = 0.3
# A stop lasts this many times the wait of a dead owner's job: shorter ones are pauses
# the reconciler must leave alone, longer ones make late writers.
STOP_LEASES = (0.5, 2.0)
SETTLE_SECONDS = 20.0


@dataclass(frozen=True)
class ForeignParams:
    """What one run does."""

    system: str = "procrastinate"
    jobs: int = 60
    kills: int = 12
    stops: int | None = None
    """Workers SIGSTOPped for a while (default: a third of ``kills``, at least 2)."""
    seconds: float = 30.0
    workers: int = 4
    replicas: int = 2
    drain_seconds: float = 120.0
    hang_max_seconds: float = 1.0
    interval_seconds: float = INTERVAL_SECONDS
    seed: int | None = None
    keep: bool = False
    effects: tuple[tuple[str, str], ...] = EFFECTS
    """The ``[kinds]`` effect of each pattern; a test declares ``effect.*`` wrongly to
    show the checks see what follows."""

    def __post_init__(self) -> None:
        if min(self.jobs, self.workers, self.replicas) < 1:
            raise ValueError("jobs, workers and replicas must be at least 1")
        if self.kills < 0 or (self.stops or 0) < 0 or self.seconds <= 0:
            raise ValueError("kills and stops must be >= 0, seconds > 0")
        if self.hang_max_seconds <= 0 or self.interval_seconds <= 0:
            raise ValueError("hang_max_seconds and interval_seconds must be > 0")

    @property
    def stop_count(self) -> int:
        return self.stops if self.stops is not None else max(2, self.kills // 3)


@dataclass
class Stats:
    """What the run did to the processes and the database."""

    worker_kills: int = 0
    replica_kills: int = 0
    stops: int = 0
    db_restarts: int = 0
    unexpected_exits: Counter[str] = field(default_factory=Counter)
    faults: FaultLog = field(default_factory=FaultLog)
    drained: bool = False
    drain_seconds: float = 0.0


@dataclass
class ForeignResult:
    """A run's parameters, what it did, and the checks."""

    params: ForeignParams
    seed: int
    stats: Stats
    checks: Checks

    @property
    def ok(self) -> bool:
        return not any(self.checks.counts.values())

    def as_json(self) -> dict[str, object]:
        p = self.params
        return {"system": p.system, "seed": self.seed, "ok": self.ok,
                "params": {"jobs": p.jobs, "kills": p.kills, "stops": p.stop_count,
                           "seconds": p.seconds, "workers": p.workers, "replicas": p.replicas,
                           "hang_max_seconds": p.hang_max_seconds},
                "faults": {"worker_kills": self.stats.worker_kills,
                           "replica_kills": self.stats.replica_kills,
                           "stops": self.stats.stops, "db_restarts": self.stats.db_restarts,
                           "unexpected_exits": dict(self.stats.unexpected_exits)},
                "drained": self.stats.drained,
                "drain_seconds": round(self.stats.drain_seconds, 1),
                "counts": self.checks.counts, "facts": self.checks.facts,
                "examples": self.checks.examples}

    def render(self) -> str:
        data = self.as_json()
        lines = [f"foreign chaos run: {self.params.system} seed={self.seed} "
                 f"{'OK' if self.ok else 'FAILED'}",
                 f"faults: {data['faults']}", f"drained: {data['drained']} "
                 f"in {data['drain_seconds']}s", "counts (all must be 0):"]
        lines += [f"  {name}: {n}" for name, n in self.checks.counts.items()]
        lines.append("facts:")
        lines += [f"  {name}: {value}" for name, value in self.checks.facts.items()]
        for name, examples in self.checks.examples.items():
            lines.append(f"  e.g. {name}: {examples}")
        return "\n".join(lines)


class ForeignRun:
    """One run; ``run()`` returns its result and leaves nothing running."""

    def __init__(self, params: ForeignParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else random.randrange(2**31)
        self.rng = random.Random(self.seed)
        self.system: System = make_system(params.system,
                                          hang_max_seconds=params.hang_max_seconds)
        self.folder = Path(tempfile.mkdtemp(prefix=f"chaos-{params.system}-"))
        self.markers = self.folder / "markers"
        self.markers.mkdir()
        self.children = Children(self.folder)
        self.stats = Stats()
        self.pg: ThrowawayPostgres | None = None
        self.db: Database | None = None
        self.config = self.folder / "reconciler.toml"
        self.specs: dict[str, JobSpec] = {}
        self.respawns: list[tuple[float, str, int]] = []
        self.replica_slots = params.replicas

    def run(self) -> ForeignResult:
        try:
            self._open()
            self._fault_phase()
            self._drain()
            assert self.db is not None
            self.stats.faults.live_at_end = {c.pid for c in self.children.live("worker")}
            checks = run_checks(self.db, self.system, self.specs, read_markers(self.markers),
                                self.stats.faults)
            unfinished = checks.examples.get("jobs_not_terminal", [])
            if unfinished:  # read before the system's broker stops
                checks.facts["unfinished_whereabouts"] = self.system.whereabouts(self.db,
                                                                                 unfinished)
            return ForeignResult(self.params, self.seed, self.stats, checks)
        finally:
            self.children.close()
            self.system.close()
            if self.pg is not None:
                self.pg.stop()
            if self.params.keep:
                print(f"kept {self.folder}", file=sys.stderr)
            else:
                shutil.rmtree(self.folder, ignore_errors=True)

    # -- set-up ---------------------------------------------------------------------------

    def _open(self) -> None:
        self.pg = ThrowawayPostgres(max_connections=300).start()
        self.pg.create_database("chaos")
        url = self.pg.url("chaos")
        self.db = Database(url, f"postgresql://postgres@{self.pg.host}:{self.pg.port}/chaos")
        engine = create_engine(url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
        self.system.prepare(self.db)
        self.config.write_text(self._config_text())
        p = self.params
        specs = [self._job_spec(n) for n in range(p.jobs)]
        ids = self.system.enqueue(self.db, specs)
        self.specs = dict(zip(ids, specs, strict=True))

    def _job_spec(self, n: int) -> JobSpec:
        p = self.params
        # A system that keeps no budget has one for all jobs, from [kinds].
        fixed = self.system.kind_rule().get("max_attempts")
        budget = int(fixed) if fixed is not None else self.rng.randint(*MAX_ATTEMPTS_RANGE)
        hang = tuple(round(self.rng.uniform(0.1, p.hang_max_seconds), 2)
                     for _ in range(budget + 1))
        delay = p.seconds * ENQUEUE_SHARE * n / max(p.jobs, 1)
        return JobSpec(KINDS[n % len(KINDS)], budget, hang, round(delay, 2))

    def _config_text(self) -> str:
        assert self.db is not None
        settings: dict[str, object] = {"database_url": self.db.url,
                                       "interval_seconds": self.params.interval_seconds,
                                       **REPLICA_SETTINGS, **self.system.settings()}
        lines = [f"{key} = {_toml(value)}" for key, value in settings.items()]
        lines += ["", "[source]", f'kind = "{self.system.name}"']
        lines += [f"{key} = {_toml(value)}" for key, value in self.system.source_table().items()]
        lines += ["", '[kinds."*"]']
        lines += [f"{key} = {_toml(value)}" for key, value in self.system.kind_rule().items()]
        for pattern, effect in self.params.effects:
            lines += ["", f'[kinds."{self.system.kind_pattern(pattern)}"]',
                      f'effect = "{effect}"']
        return "\n".join(lines) + "\n"

    # -- processes --------------------------------------------------------------------------

    def _spawn(self, role: str, slot: int) -> Child:
        assert self.db is not None
        if role == "worker":
            argv, env = self.system.worker_command(self.db, self.markers, slot)
        else:
            argv = [sys.executable, "-m", "reconciler.cli", "run", "--config", str(self.config)]
            env = {}
        return self.children.start(role, slot, argv, env, REPO_ROOT)

    def _reap_and_respawn(self, now: float) -> None:
        """Schedule a restart of every child that died; start those due."""
        for child in list(self.children.started):
            if child.reaped or child.alive():
                continue
            # Each death is handled once, by itself: a slot's earlier dead child must not
            # mask a later one's exit (it used to schedule the slot's respawn first, and the
            # later child, seeing a respawn due, was never counted nor aged: its job stayed
            # `started` with a minute-long entry, jobs_not_terminal under load).
            child.reaped = True
            if child.role == "replica" and child.slot >= self.replica_slots:
                continue
            cause = None if child.killed else exit_cause(child)
            if cause is not None:
                self.stats.unexpected_exits[cause] += 1
                if child.role == "worker":
                    self.system.age(child.pid)
            if not any(c.role == child.role and c.slot == child.slot and c.alive()
                       for c in self.children.started) and not any(
                    r[1:] == (child.role, child.slot) for r in self.respawns):
                delay = (SUPERVISOR_RESTART_SECONDS if cause == NAME_TAKEN
                         else self.rng.uniform(*RESPAWN_DELAY_SECONDS))
                self.respawns.append((now + delay, child.role, child.slot))
        due = [r for r in self.respawns if r[0] <= now]
        self.respawns = [r for r in self.respawns if r[0] > now]
        for _, role, slot in due:
            self._spawn(role, slot)

    def _continue_stopped(self, now: float, *, all_of_them: bool = False) -> None:
        for child in self.children.started:
            if child.stopped_until is not None and (all_of_them or now >= child.stopped_until):
                child.signal(signal.SIGCONT)
                child.stopped_until = None

    # -- faults -----------------------------------------------------------------------------

    def _fault_schedule(self) -> list[tuple[float, str]]:
        p = self.params
        span = p.seconds * FAULTS_DONE_BY_SHARE
        replica_kills = max(1, round(p.kills * REPLICA_KILL_SHARE)) if p.kills else 0
        events = [(self.rng.uniform(0.05, 1) * span, "kill_worker")
                  for _ in range(p.kills - replica_kills)]
        events += [(self.rng.uniform(0.1, 1) * span, "kill_replica")
                   for _ in range(replica_kills)]
        events += [(self.rng.uniform(0.05, 0.8) * span, "stop_worker")
                   for _ in range(p.stop_count)]
        events.append((self.rng.uniform(0.3, 0.6) * p.seconds, "restart_db"))
        return sorted(events)

    def _fault(self, what: str, now: float) -> bool:
        """Cause the fault; False when it has to wait (no worker to stop or kill now)."""
        if what == "restart_db":
            assert self.pg is not None
            if not self.system.restart_store():  # RQ's Redis, else PostgreSQL
                self.pg.restart(mode="immediate")
            self.stats.db_restarts += 1
            return True
        if what == "kill_replica":
            replicas = self.children.live("replica")
            if not replicas:
                return False
            self.children.kill(self.rng.choice(replicas))
            self.stats.replica_kills += 1
            return True
        running = [c for c in self.children.live("worker") if c.stopped_until is None]
        inside = mid_task(read_markers(self.markers))
        busy = [c for c in running if c.pid in inside]
        if what == "stop_worker":
            if not busy or len(running) < 2:  # none inside a task, or the last one running
                return False
            victim = self.rng.choice(busy)  # a worker inside a task: the late writer
            victim.signal(signal.SIGSTOP)
            lease = self.system.reclaim_after_seconds
            leases = self.rng.uniform(*STOP_LEASES)
            victim.stopped_until = now + leases * lease
            if leases > 1:  # a late writer: its expiry passes while it is stopped
                self.system.age(victim.pid)
            self.stats.stops += 1
            self.stats.faults.stopped.add(victim.pid)
            return True
        if not self.stats.faults.killed_mid_task and not busy:
            # The first kill waits for a worker inside a task: a run whose kills all hit
            # idle workers (the work done before most faults, on a loaded machine) gives the
            # replicas nothing to decide and proves nothing.
            return False
        pool = busy if busy and (not self.stats.faults.killed_mid_task
                                 or self.rng.random() < MID_TASK_KILL_CHANCE) else running
        if not pool:  # every worker is dead or stopped: try again shortly
            return False
        victim = self.rng.choice(pool)
        self.children.kill(victim)
        self.system.age(victim.pid)
        self.stats.faults.killed_at[victim.pid] = time.time()
        if victim in busy:
            self.stats.faults.killed_mid_task.add(victim.pid)
        self.stats.worker_kills += 1
        return True

    # -- phases -----------------------------------------------------------------------------

    def _fault_phase(self) -> None:
        p = self.params
        for slot in range(p.replicas):
            self._spawn("replica", slot)
        for slot in range(p.workers):
            self._spawn("worker", slot)
        schedule = self._fault_schedule()
        started = time.monotonic()
        while (now := time.monotonic()) < started + p.seconds:
            while schedule and now - started >= schedule[0][0]:
                at, what = schedule.pop(0)
                if not self._fault(what, now):
                    schedule = sorted([*schedule, (at + RETRY_FAULT_SECONDS, what)])
                    break
            self._continue_stopped(now)
            self._reap_and_respawn(now)
            time.sleep(TICK_SECONDS)
        for _, what in schedule:  # a busy machine fell behind: the rest at once
            if what != "stop_worker":
                self._fault(what, time.monotonic())

    def _drain(self) -> None:
        assert self.db is not None
        self._continue_stopped(time.monotonic(), all_of_them=True)
        self.replica_slots = 1
        for replica in self.children.live("replica"):
            if replica.slot > 0:
                self.children.kill(replica)
        self.respawns = [r for r in self.respawns if r[1] == "worker" or r[2] == 0]
        started = time.monotonic()
        deadline = started + self.params.drain_seconds
        while time.monotonic() < deadline:
            states = self.system.states(self.db, self.specs)
            if len(states) == len(self.specs) and all(s.status in TERMINAL
                                                      for s in states.values()):
                self.stats.drained = True
                break
            self._reap_and_respawn(time.monotonic())
            self.system.maintain()
            time.sleep(0.5)
        self.stats.drain_seconds = time.monotonic() - started
        # Late writers finish their task and write what they write, then everything stops.
        settle = time.monotonic() + SETTLE_SECONDS
        while time.monotonic() < settle:
            live = {c.pid for c in self.children.live("worker")}
            if not live & mid_task(read_markers(self.markers)):
                break
            time.sleep(0.2)
        time.sleep(1.0)  # their completion reaches the database after the marker


def _toml(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value).lower() if isinstance(value, bool) else repr(value)


def run_foreign_chaos(params: ForeignParams) -> ForeignResult:
    """Run once with these parameters."""
    return ForeignRun(params).run()
