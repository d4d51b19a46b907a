"""``--measure time_to_recovery``: how long orphans wait once their workers die, replica and all.

    python -m benchmarks --measure time_to_recovery [--engine both] [--orphans 10000]
    python -m benchmarks --measure time_to_recovery --smoke     # under a minute, for CI

A sidecar runs beside the workers it must rescue, so a node that dies takes both. Each
**time_to_recovery** scenario, on a fresh database and with real processes:

1. R + 1 replicas start (``reconciler run``, the scenario's settings) and answer ``/readyz``.
2. N jobs are queued; W worker processes (benchmarks/orphans.py) each register a session,
   heartbeat it, claim their share and say so.
3. Every worker and the replica beside them (the one holding the chores' leader lease;
   every replica passes) are SIGKILLed at once; R replicas are left running.
4. The run waits until no job is ``processing``, printing progress every few seconds.

When does an orphan's lease run out? A live worker renews its claims' leases; a dead one
stops, and its session stops heartbeating. The contract lets a pass take the job at the
earlier of its lease's expiry and its session's last heartbeat + ``session_timeout_seconds``
(the pass then declares the session gone and expires the lease at once). Thousands of
claims cannot be renewed by a few processes, so the workers claim under a lease that
outlasts the claim phase and the session decides: each job is due at its session's last
heartbeat + ``session_timeout_seconds`` (30 s by default, as the worker's lease). The
figure is the time from the last orphan coming due to the last orphan decided
(``reconciliation_decisions.decided_at``), all on the database's clock; ``max_lag_s`` is
the worst job's wait from its own due time, against the goal of ``interval_seconds`` + 2 s.
The baseline, measured in the same run on the same engine: ``floor_s``, the pass deciding
the same number of orphans back to back in-process.

**backlog_drain** (PostgreSQL and MariaDB): a backlog of B orphans (benchmarks/dataset.py's
stale jobs) whose leases all run out at one moment once the replicas are up (one UPDATE, as a pass
does when it finds their session gone), decided by 1 and then by 2 replicas; jobs per
second from the first decision to the last, and two replicas' speedup over one measured
in the same run (goal: 1.6). Beside it, what the replicas did, from their own logs:
``passes``, the median ``pass_ms``, ``batches_per_tick`` (a tick runs full batches back
to back, up to 20 or half its interval, and one that stops with its last batch full is
followed by the next at once) and ``busy``, the share of the drain a replica spent
passing: a rate with ``busy`` near 1 is the pass's own speed, one well under 1 is ticks
waiting for the scheduler. ``replica_cores``: the CPU a replica process used while the
backlog drained, in cores (Linux), and ``load`` the machine's load average at the end:
two replicas that each use less than before, with ``busy`` near 1, are waiting for CPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from benchmarks.dataset import Shape, build
from benchmarks.harness import Databases, Measurement, drain, store_on
from benchmarks.processes import (
    PROGRESS_SECONDS,
    Children,
    children,
    cpu_seconds,
    replica_work,
    say,
    shares_of,
    start_orphan_workers,
    start_replicas,
    wait_ready,
)
from models import (
    JobRun,
    ReconcilerLease,
    ReconciliationDecision,
    ReconciliationPass,
    WorkerSession,
)
from reconciler.storage.clock import db_now
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient, Step

JOBS = cast(sa.Table, JobRun.__table__)
DECISIONS = cast(sa.Table, ReconciliationDecision.__table__)
PASSES = cast(sa.Table, ReconciliationPass.__table__)
LEASES = cast(sa.Table, ReconcilerLease.__table__)
SESSIONS = cast(sa.Table, WorkerSession.__table__)
PLAN = (Step("fetch", "idempotent"), Step("render", "pure"), Step("publish", "effectful"))
GOAL_MARGIN_SECONDS = 2.0
GOAL_SPEEDUP = 1.6
POLL_SECONDS = 0.5


@dataclass(frozen=True)
class Scenario:
    """One time_to_recovery configuration: settings for replicas and workers alike."""

    name: str
    settings: dict[str, float] = field(default_factory=dict)

    @property
    def interval_seconds(self) -> float:
        return self.settings.get("interval_seconds", 30.0)

    @property
    def session_timeout_seconds(self) -> float:
        return self.settings.get("session_timeout_seconds", 30.0)


@dataclass(frozen=True)
class RecoveryPlan:
    """Sizes and settings of one run of these measurements."""

    orphans: int
    replicas: int
    workers: int
    backlog: int
    scenarios: tuple[Scenario, ...]
    backlog_settings: dict[str, float]
    timeout_seconds: float


# Every worker dying at once is exactly what the mass-staleness brake holds back for
# brake_hold_seconds (it looks like an outage); these scenarios measure recovery itself, so
# the brake is off. With it on, add brake_hold_seconds to every figure.
NO_BRAKE = {"brake_hold_seconds": 0.0}


def plan_for(*, smoke: bool, orphans: int, replicas: int, workers: int, backlog: int,
             timeout_seconds: float) -> RecoveryPlan:
    """The full plan (the defaults and interval_seconds = 5), or the smoke one for CI."""
    if smoke:
        # Short everything, so both engines fit in a minute; only checks that it runs.
        fast = {"interval_seconds": 1.0, "leader_lease_seconds": 4.0,
                "session_timeout_seconds": 4.0, "session_heartbeat_seconds": 1.0,
                **NO_BRAKE}
        return RecoveryPlan(orphans=200, replicas=1, workers=1, backlog=2000,
                            scenarios=(Scenario("smoke", fast),),
                            backlog_settings={"interval_seconds": 1.0, **NO_BRAKE},
                            timeout_seconds=60.0)
    return RecoveryPlan(orphans=orphans, replicas=replicas, workers=workers, backlog=backlog,
                        scenarios=(Scenario("defaults", NO_BRAKE),
                                   Scenario("interval_5", {"interval_seconds": 5.0, **NO_BRAKE})),
                        backlog_settings={"interval_seconds": 1.0, **NO_BRAKE},
                        timeout_seconds=timeout_seconds)


def wait_claimed(group: Children, processes: list[subprocess.Popen[bytes]], engine: Engine,
                 jobs: int) -> None:
    """Wait until every worker says it holds its share."""
    last_said = time.monotonic()
    while (held := _processing(engine)) < jobs:
        if any(p.poll() is not None for p in processes):
            failed = next(p for p in processes if p.poll() is not None)
            raise SystemExit(f"a worker failed to claim its jobs:\n{group.tail(failed)}")
        if time.monotonic() - last_said >= PROGRESS_SECONDS:
            last_said = time.monotonic()
            say(f"{held}/{jobs} jobs claimed")
        time.sleep(POLL_SECONDS)
    shares = shares_of(jobs, len(processes))
    claimed = 0
    for process, share in zip(processes, shares, strict=True):
        assert process.stdout is not None
        line = process.stdout.readline().decode().split()
        if line[:1] != ["ready"]:
            raise SystemExit(f"a worker failed to claim its jobs:\n{group.tail(process)}")
        claimed += int(line[1])
        if int(line[1]) != share:
            raise SystemExit(f"a worker claimed {line[1]} of its {share} jobs")
    say(f"{claimed} jobs claimed by {len(processes)} worker processes")


# -- reading the outcome ---------------------------------------------------------------------


def _processing(engine: Engine, *where: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(JOBS).where(
            JOBS.c.job_status == "processing", *where)).scalar_one())


def _lease_holder(engine: Engine) -> str | None:
    """Whoever holds a live reconciler lease (whatever it is named), if anyone."""
    with engine.connect() as conn:
        return conn.execute(sa.select(LEASES.c.holder_id)
                            .where(LEASES.c.lease_expires_at > db_now())
                            .order_by(LEASES.c.lease_name).limit(1)).scalar_one_or_none()


def _decisions(engine: Engine) -> list[tuple[int, datetime, str]]:
    """(job, decided_at, instance) of every non-skip decision, oldest first."""
    with engine.connect() as conn:
        return [(int(j), d, str(i)) for j, d, i in conn.execute(
            sa.select(DECISIONS.c.job_id, DECISIONS.c.decided_at,
                      PASSES.c.reconciler_instance)
            .join(PASSES, PASSES.c.pass_id == DECISIONS.c.pass_id)
            .where(DECISIONS.c.disposition != "skip")
            .order_by(DECISIONS.c.decided_at))]


def _due_times(engine: Engine, session_timeout_seconds: float
               ) -> tuple[dict[int, datetime], datetime]:
    """When each processing job may first be taken, read just after the kill; and now.

    The earlier of its lease's end and its session's last heartbeat + the timeout, and
    never before the kill (a job is an orphan only once its worker is dead).
    """
    with engine.connect() as conn:
        now = conn.execute(sa.select(db_now())).scalar_one()
        rows = conn.execute(
            sa.select(JOBS.c.job_id, JOBS.c.lease_expires_at, SESSIONS.c.heartbeat_at)
            .join(SESSIONS, SESSIONS.c.session_id == JOBS.c.worker_session_id)
            .where(JOBS.c.job_status == "processing")).all()
    timeout = timedelta(seconds=session_timeout_seconds)
    return {int(j): max(min(lease, beat + timeout), now) for j, lease, beat in rows}, now


def wait_until_decided(engine: Engine, what: str, total: int, timeout_seconds: float,
                       alive: Callable[[], bool], *where: Any) -> bool:
    """Poll until no matching job is processing; False at the timeout. Progress on stderr."""
    started = last_said = time.monotonic()
    while True:
        left = _processing(engine, *where)
        if left == 0:
            return True
        now = time.monotonic()
        if now - started > timeout_seconds:
            say(f"{what}: timed out after {timeout_seconds:.0f} s with {left} undecided")
            return False
        if not alive():
            raise SystemExit(f"{what}: every replica left running has exited")
        if now - last_said >= PROGRESS_SECONDS:
            last_said = now
            say(f"{what}: {total - left}/{total} decided, {now - started:.0f} s")
        time.sleep(POLL_SECONDS)


# -- the measurements ------------------------------------------------------------------------


def _url(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def _enqueue(engine: Engine, jobs: int) -> None:
    client = JobClient(engine)
    with engine.begin() as conn:
        for _ in range(jobs):
            client.enqueue("bench", steps=PLAN, connection=conn)


def recovery_floor(dbs: Databases, orphans: int, drain: Callable[[SqlStore, int], Any]
                   ) -> float:
    """The pass deciding ``orphans`` stale jobs back to back in this process, in seconds."""
    with dbs.fresh() as engine:
        build(engine, Shape(jobs=max(orphans * 2, 1000), stale=orphans))
        store = store_on(engine)
        started = time.perf_counter()
        drain(store, 500)
        return time.perf_counter() - started


def time_to_recovery(dbs: Databases, plan: RecoveryPlan, scenario: Scenario,
                     floor_seconds: float) -> Measurement:
    """One scenario: orphans made by real workers, killed with the replica beside them."""
    n, engine_name = plan.orphans, dbs.engine_name
    what = f"time_to_recovery {engine_name} {scenario.name}"
    tag = uuid.uuid4().hex[:6]
    with dbs.fresh() as engine, children() as group:
        url = _url(engine)
        # Everything starts at once: interpreters take seconds to start on a small machine.
        _enqueue(engine, n)
        replicas = start_replicas(group, url, scenario.settings, plan.replicas + 1, tag)
        workers = start_orphan_workers(group, url, scenario.settings, n,
                                       workers=plan.workers, tag=tag)
        wait_ready(group, replicas)
        wait_claimed(group, workers, engine, n)
        holder = _lease_holder(engine)
        beside = next((r for r in replicas if r.name == holder), replicas[0])
        for process in [*workers, beside.process]:
            process.send_signal(signal.SIGKILL)
        for process in [*workers, beside.process]:
            process.wait()
        due, killed_at = _due_times(engine, scenario.session_timeout_seconds)
        survivors = [r for r in replicas if r is not beside]
        say(f"{what}: {len(workers)} workers and replica {beside.name} killed; "
            f"{len(survivors)} replicas left")
        done = wait_until_decided(
            engine, what, n, plan.timeout_seconds,
            lambda: any(r.process.poll() is None for r in survivors))
        decided = _decisions(engine)
        for replica in survivors:
            replica.stop()
    first: dict[int, datetime] = {}
    for job_id, at, _instance in decided:
        first.setdefault(job_id, at)
    lags = [(first[j] - due[j]).total_seconds() for j in first if j in due]
    value = ((max(first.values()) - max(due.values())).total_seconds() if first
             else float("nan"))
    goal = scenario.interval_seconds + GOAL_MARGIN_SECONDS
    max_lag = max(lags) if lags else float("nan")
    extra: dict[str, Any] = {
        "scenario": scenario.name, "interval_seconds": scenario.interval_seconds,
        "replicas_left": plan.replicas, "workers": plan.workers,
        "max_lag_s": round(max_lag, 1), "goal_s": goal,
        "met": bool(done and max_lag <= goal), "floor_s": round(floor_seconds, 2),
        "decided": len(first), "decided_twice": len(decided) - len(first),
        "deciding_replicas": len({instance for _j, _a, instance in decided}),
        "due_before_kill": sum(1 for at in due.values() if at <= killed_at),
    }
    if not done:
        extra["timed_out"] = True
    return Measurement("time_to_recovery", engine_name, n, n, round(value, 1), "s", extra)


def backlog_drain(dbs: Databases, plan: RecoveryPlan, replicas: int) -> Measurement:
    """B orphans whose leases run out at one moment, decided by ``replicas`` replicas."""
    b = plan.backlog
    what = f"backlog_drain {dbs.engine_name} replicas={replicas}"
    tag = uuid.uuid4().hex[:6]
    with dbs.fresh() as engine, children() as group:
        running = start_replicas(group, _url(engine), plan.backlog_settings, replicas, tag)
        # Built with live leases (an hour ahead): nothing to decide until all are up.
        build(engine, Shape(jobs=b * 2, stale=b), stale_lease_seconds=3600)
        wait_ready(group, running)
        with engine.begin() as conn:
            conn.execute(JOBS.update().where(JOBS.c.job_id <= b, JOBS.c.job_status == "processing")
                         .values(lease_expires_at=db_now()))
            lease_end = conn.execute(sa.select(sa.func.max(JOBS.c.lease_expires_at))
                                     .where(JOBS.c.job_id <= b)).scalar_one()
        say(f"{what}: {replicas} replicas ready; {b} leases ran out")
        cpu_from, watch_from = cpu_seconds(running), time.monotonic()
        done = wait_until_decided(
            engine, what, b, plan.timeout_seconds,
            lambda: any(r.process.poll() is None for r in running), JOBS.c.job_id <= b)
        cpu_to, watched = cpu_seconds(running), time.monotonic() - watch_from
        # The audit keeps job ids as text (any source's ids): compare them as numbers here.
        decided = [d for d in _decisions(engine) if d[0] <= b]
        for replica in running:
            replica.stop()
        span = (decided[-1][1] - decided[0][1]).total_seconds() if decided else float("nan")
        work = replica_work(group, running, span)
    extra: dict[str, Any] = {
        "replicas": replicas, "interval_seconds": plan.backlog_settings["interval_seconds"],
        "seconds": round(span, 2),
        "wait_s": round((decided[0][1] - lease_end).total_seconds(), 2) if decided else None,
        "decided": len({j for j, _a, _i in decided}),
        "deciding_replicas": len({i for _j, _a, i in decided}),
        **work,
        "replica_cores": (round((cpu_to - cpu_from) / watched / replicas, 2)
                          if cpu_from is not None and cpu_to is not None else None),
        "load": round(os.getloadavg()[0], 1),
    }
    if not done:
        extra["timed_out"] = True
    return Measurement("backlog_drain", dbs.engine_name, b * 2, b,
                       round(len(decided) / span) if span > 0 else 0, "jobs/s", extra)


def run_recovery(dbs: Databases, plan: RecoveryPlan, emit: Callable[[Measurement], None]
                 ) -> bool:
    """Every recovery measurement on one engine, emitted as made.

    False if one timed out or decided a job twice: figures that miss a goal are still a
    run that worked, but those two are not.
    """
    ok = True
    floor = recovery_floor(dbs, plan.orphans, drain)
    for scenario in plan.scenarios:
        m = time_to_recovery(dbs, plan, scenario, floor)
        ok = ok and not m.extra.get("timed_out", False) and m.extra["decided_twice"] == 0
        emit(m)
    if dbs.engine_name != "sqlite":
        one = backlog_drain(dbs, plan, 1)
        emit(one)
        two = backlog_drain(dbs, plan, 2)
        two.extra["speedup"] = round(two.value / one.value, 2) if one.value else None
        two.extra["goal_speedup"] = GOAL_SPEEDUP
        emit(two)
        ok = ok and not one.extra.get("timed_out") and not two.extra.get("timed_out")
    return ok
