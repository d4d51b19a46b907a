"""Real graphile-worker and pg-boss workers (Node 20), SIGKILLed and SIGSTOPped mid-task.

Neither system keeps owner liveness, so the lease is the claim time plus the kind's
``max_run_seconds`` (1.5 s here). Every recovery is finished by a new worker process of the
system itself, from npm (tests/sources/node/*.js).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.ports import JobKey
from reconciler.core.vocabulary import Disposition, EffectKind, Reason
from tests.sources.conftest import NODE_DIR, SourcesDatabase, node_env
from tests.sources.factories import GraphileWorkerFactory, PgBossFactory
from tests.sources.support import (
    RECOVERY_POLL_SECONDS,
    Markers,
    Outcome,
    Process,
    Processes,
    reconcile_once,
    record_finding,
    wait_until,
)

MAX_RUN_SECONDS = 1.5
KINDS = KindRules([KindRule("*", max_run_seconds=MAX_RUN_SECONDS),
                   KindRule("idem.*", effect=EffectKind.IDEMPOTENT),
                   KindRule("pure.*", effect=EffectKind.PURE),
                   KindRule("slow.*", effect=EffectKind.IDEMPOTENT, max_run_seconds=60.0)],
                  stale_after_seconds=60.0, wedged_after_seconds=3600.0, max_attempts=3,
                  crash_loop_after=2)
QUEUES = ("idem.work", "effect.work", "pure.work")


@dataclass
class NodeSystem:
    """One Node job system: how to enqueue, start a worker, read a job."""

    name: str
    factory: GraphileWorkerFactory | PgBossFactory
    node_modules: Path
    markers: Markers

    @property
    def first_attempt(self) -> int:
        """The attempt number a task sees on its first run."""
        return 1 if self.name == "graphile-worker" else 0

    def enqueue(self, kind: str, hang: Sequence[float] | None = None) -> JobKey:
        payload = {} if hang is None else {"hang": list(hang)}
        if isinstance(self.factory, GraphileWorkerFactory):
            return self.factory.add(kind, payload)
        # pg-boss's own expiry far away: only the reconciler's lease is in play.
        return self.factory.send(kind, payload, expire_seconds=3600)

    def start(self, processes: Processes, name: str, **env: str) -> Process:
        """A worker of the system (``env``: more of its environment)."""
        db: SourcesDatabase = self.factory.db
        script = ("graphile_worker_runner.js" if self.name == "graphile-worker"
                  else "pgboss_runner.js")
        queues = () if self.name == "graphile-worker" else QUEUES
        for queue in queues:
            assert isinstance(self.factory, PgBossFactory)
            self.factory.queue(queue)
        worker = processes.start(name, ["node", str(NODE_DIR / script), "worker", *queues],
                                 {**node_env(self.node_modules, db, self.markers.folder),
                                  **env})
        wait_until(lambda: self.markers.has(f"worker-ready-{worker.pid}"),
                   f"{self.name} worker to start", process=worker)
        return worker

    def done(self, job: JobKey) -> bool:
        """Completed its own way: graphile-worker deletes the row, pg-boss marks it."""
        return self.factory.status(job) == (
            "absent" if self.name == "graphile-worker" else "completed")

    def recover(self, job: JobKey, worker: Process, kinds: KindRules = KINDS) -> Outcome:
        """Reconcile until the job is decided (its lease has run out)."""
        def decided() -> Outcome | None:
            for outcome in reconcile_once(self.factory.db.engine, self.factory.config,
                                          kinds):
                if str(outcome.job_id) == str(job):
                    return outcome
            return None

        outcome: Outcome = wait_until(decided, f"a decision on job {job}", timeout=20,
                                      process=worker, every=RECOVERY_POLL_SECONDS)
        return outcome

    def row(self, job: JobKey) -> dict[str, Any] | None:
        return self.factory.row(job)


@pytest.fixture(params=("graphile-worker", "pg-boss"))
def node_system(request: pytest.FixtureRequest, node_modules: Path,
                tmp_path: Path) -> NodeSystem:
    """graphile-worker, then pg-boss, on empty job tables."""
    if request.param == "graphile-worker":
        factory: GraphileWorkerFactory | PgBossFactory = GraphileWorkerFactory(
            request.getfixturevalue("graphile_db"), request.getfixturevalue("graphile_schema"))
    else:
        factory = PgBossFactory(request.getfixturevalue("pgboss_db"),
                                request.getfixturevalue("pgboss_schema"))
    return NodeSystem(request.param, factory, node_modules, Markers(tmp_path / "markers"))


class TestKilledWorker:
    """A worker SIGKILLed mid-task: its job is recovered once its lease has run out."""

    def test_idempotent_job_is_resumed_and_finished_by_the_system(
            self, node_system: NodeSystem, processes: Processes) -> None:
        """Requeued the system's way, then run to the end by a new worker of its own."""
        system, first_try = node_system, node_system.first_attempt
        job = system.enqueue("idem.work")
        first = system.start(processes, "worker-a")
        wait_until(lambda: system.markers.has(f"{job}-started-{first_try}"),
                   "the task to start", process=first)
        claimed = system.row(job)
        first.kill()
        killed_at = time.monotonic()
        second = system.start(processes, "worker-b")
        outcome = system.recover(job, first)
        decided_after = time.monotonic() - killed_at
        assert (outcome.disposition, outcome.reason) == (Disposition.RESUME,
                                                         Reason.RESUMED_IDEMPOTENT_STEP)
        assert outcome.applied
        wait_until(lambda: system.done(job), "the new worker to finish the job",
                   process=second)
        assert system.markers.of(job) == {f"started-{first_try}", f"started-{first_try + 1}",
                                          f"done-{first_try + 1}"}
        record_finding(system.name, "killed_worker_recovered", job_id=job,
                       decision=outcome.reason.value,
                       decided_seconds_after_kill=round(decided_after, 2),
                       claimed=claimed, final=system.row(job),
                       markers=sorted(system.markers.of(job)))

    def test_effectful_job_is_failed_and_never_rerun(
            self, node_system: NodeSystem, processes: Processes) -> None:
        """The default effect: failed the system's way with our reason, never run again."""
        system, first_try = node_system, node_system.first_attempt
        job = system.enqueue("effect.work")
        first = system.start(processes, "worker-a")
        wait_until(lambda: system.markers.has(f"{job}-started-{first_try}"),
                   "the task to start", process=first)
        first.kill()
        second = system.start(processes, "worker-b")
        outcome = system.recover(job, first)
        assert outcome.reason is Reason.WORKER_DIED_MID_STEP
        later = system.enqueue("pure.work", hang=[])
        wait_until(lambda: system.done(later), "a later job to run", process=second)
        assert system.markers.of(job) == {f"started-{first_try}"}
        assert system.factory.status(job) == "failed"
        assert system.factory.error_text(job) == "worker_died_mid_step"
        record_finding(system.name, "effectful_terminalized", job_id=job, row=system.row(job))


class TestCrashLoop:
    """A job that kills every worker that runs it is quarantined, not handed to a third."""

    def test_second_killed_worker_in_a_row_ends_the_job_crash_loop(
            self, node_system: NodeSystem, processes: Processes) -> None:
        """Killed inside an idempotent job, resumed; the system's next worker dies on it
        too; the next pass ends it ``crash_loop`` (two lost in a row, the default), and a
        third worker never starts it."""
        system, first_try = node_system, node_system.first_attempt
        job = system.enqueue("idem.work", hang=[3600.0, 3600.0, 3600.0])
        first = system.start(processes, "worker-a")
        wait_until(lambda: system.markers.has(f"{job}-started-{first_try}"),
                   "the task to start", process=first)
        first.kill()
        second = system.start(processes, "worker-b")
        resumed = system.recover(job, first)
        assert (resumed.reason, resumed.evidence["lost_attempts_in_a_row"]) == (
            Reason.RESUMED_IDEMPOTENT_STEP, 1)
        wait_until(lambda: system.markers.has(f"{job}-started-{first_try + 1}"),
                   "the next worker to start the job", process=second)
        second.kill()
        third = system.start(processes, "worker-c")
        ended = system.recover(job, second)
        assert (ended.disposition, ended.reason, ended.evidence["lost_attempts_in_a_row"]) == (
            Disposition.TERMINALIZE, Reason.CRASH_LOOP, 2)
        later = system.enqueue("pure.work", hang=[])
        wait_until(lambda: system.done(later), "a later job to run", process=third)
        assert system.markers.of(job) == {f"started-{first_try}", f"started-{first_try + 1}"}
        assert system.factory.status(job) == "failed"


class TestLiveWorker:
    """A worker inside its kind's max_run_seconds keeps its job (no liveness but the lease)."""

    def test_job_inside_its_lease_is_never_touched(
            self, node_system: NodeSystem, processes: Processes) -> None:
        """Passes over a second leave a job of a 60 s kind running on its worker."""
        system = node_system
        job = system.enqueue("idem.work")
        worker = system.start(processes, "worker-a")
        wait_until(lambda: system.markers.has(f"{job}-started-{system.first_attempt}"),
                   "the task to start", process=worker)
        claimed = system.row(job)
        slow = KindRules([KindRule("*", effect=EffectKind.IDEMPOTENT, max_run_seconds=60.0)],
                         stale_after_seconds=60.0, wedged_after_seconds=3600.0, max_attempts=3)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert reconcile_once(system.factory.db.engine, system.factory.config,
                                  slow) == []
            time.sleep(0.25)
        assert system.row(job) == claimed
        assert worker.alive()


class TestLateWriter:
    """The old worker SIGSTOPped past its lease, its job reclaimed, then SIGCONTed."""

    def test_late_completion(self, node_system: NodeSystem, processes: Processes) -> None:
        """Neither system fences a completion on the claim: the old worker's late completion
        lands on the new worker's run. Ours: one swap, at most two runs, no third."""
        system, first_try = node_system, node_system.first_attempt
        job = system.enqueue("idem.work", hang=[2.0, 4.0])
        old = system.start(processes, "worker-old")
        wait_until(lambda: system.markers.has(f"{job}-started-{first_try}"),
                   "the task to start", process=old)
        old.signal(signal.SIGSTOP)
        new = system.start(processes, "worker-new")
        outcome = system.recover(job, old)
        assert outcome.disposition is Disposition.RESUME
        assert outcome.applied
        wait_until(lambda: system.markers.has(f"{job}-started-{first_try + 1}"),
                   "the new run to start", process=new)
        running_new = system.row(job)
        old.signal(signal.SIGCONT)
        wait_until(lambda: system.markers.has(f"{job}-done-{first_try}"),
                   "the old run to end", process=old)
        time.sleep(0.5)
        after_old = system.row(job)
        wait_until(lambda: system.markers.has(f"{job}-done-{first_try + 1}"),
                   "the new run to end", process=new)
        time.sleep(0.5)
        after_new = system.row(job)
        record_finding(system.name, "late_writer", job_id=job, while_new_runs=running_new,
                       after_old_finished=after_old, after_new_finished=after_new,
                       markers=sorted(system.markers.of(job)))
        # Ours: the job ran twice (the stopped run and the resumed one), never a third time.
        assert sorted(system.markers.of(job)) == sorted(
            [f"started-{first_try}", f"done-{first_try}", f"started-{first_try + 1}",
             f"done-{first_try + 1}"])
        # Theirs, as observed: the old worker's completion hit the new worker's run.
        if system.name == "graphile-worker":
            assert after_old is None  # deleted by id while the new worker still ran it
        else:
            assert after_old is not None
            assert after_old["state"] == "completed"  # completed under the new run
