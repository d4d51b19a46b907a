"""Real Procrastinate workers, SIGKILLed and SIGSTOPped mid-task, recovered by the source.

Workers run ``tests/sources/procrastinate_app.py`` (heartbeat every 0.3 s); the source
judges a worker gone after 2 s of silence. Every recovery is finished by a new worker of
Procrastinate's own.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.vocabulary import Disposition, EffectKind, Reason
from tests.sources.conftest import SourcesDatabase
from tests.sources.factories import ProcrastinateFactory
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

TIMEOUT_SECONDS = 2.0  # heartbeats every 0.3 s: a wide margin on a loaded machine
KINDS = KindRules([KindRule("idem.*", effect=EffectKind.IDEMPOTENT),
                   KindRule("pure.*", effect=EffectKind.PURE)],
                  stale_after_seconds=60.0, wedged_after_seconds=3600.0, max_attempts=3)


@pytest.fixture
def procrastinate(procrastinate_db: SourcesDatabase, procrastinate_schema: str
                  ) -> ProcrastinateFactory:
    """Procrastinate's tables, empty, judged with a 2 s session timeout."""
    return ProcrastinateFactory(procrastinate_db, procrastinate_schema,
                                session_timeout_seconds=TIMEOUT_SECONDS)


@pytest.fixture
def markers(tmp_path: Path) -> Markers:
    return Markers(tmp_path / "markers")


def start_worker(processes: Processes, factory: ProcrastinateFactory, markers: Markers,
                 name: str) -> Process:
    """A Procrastinate worker process of its own."""
    db = factory.db
    return processes.start(name, [sys.executable, "-m", "tests.sources.procrastinate_app"], {
        "SOURCES_PG_CONNINFO": db.conninfo(f"{factory.schema},public"),
        "SOURCES_MARKERS": str(markers.folder), "SOURCES_DATABASE_URL": db.url,
        "SOURCES_STALLED_SECONDS": str(TIMEOUT_SECONDS)}, cwd=Path(__file__).parents[2])


def recover(factory: ProcrastinateFactory, job: int, worker: Process) -> Outcome:
    """Run reconcile steps until the job is decided (its owner judged gone)."""
    def decided() -> Outcome | None:
        for outcome in reconcile_once(factory.db.engine, factory.config, KINDS):
            if outcome.job_id == job:
                return outcome
        return None

    outcome: Outcome = wait_until(decided, f"a decision on job {job}", timeout=20,
                                  process=worker, every=RECOVERY_POLL_SECONDS)
    return outcome


class TestKilledWorker:
    """A worker SIGKILLed mid-task: its job is recovered the way its kind allows."""

    def test_idempotent_job_is_resumed_and_finished_by_procrastinate(
            self, procrastinate: ProcrastinateFactory, processes: Processes,
            markers: Markers) -> None:
        """Retried through Procrastinate's function, then run to the end by a new worker."""
        job = procrastinate.defer("idem.work")
        first = start_worker(processes, procrastinate, markers, "worker-a")
        wait_until(lambda: markers.has(f"{job}-started-0"), "the task to start", process=first)
        first.kill()
        killed_at = time.monotonic()
        # Started now, it idles until the job is queued again (it never takes a doing job).
        second = start_worker(processes, procrastinate, markers, "worker-b")
        outcome = recover(procrastinate, job, first)
        decided_after = time.monotonic() - killed_at
        assert (outcome.disposition, outcome.reason) == (Disposition.RESUME,
                                                         Reason.RESUMED_IDEMPOTENT_STEP)
        assert outcome.applied
        wait_until(lambda: procrastinate.status(job) == "completed",
                   "the new worker to finish the job", process=second)
        assert markers.of(job) == {"started-0", "started-1", "done-1"}
        events = procrastinate.events(job)
        assert events == ["deferred", "started", "deferred_for_retry", "started", "succeeded"]
        record_finding("procrastinate", "killed_worker_recovered", job_id=job,
                       decision=outcome.reason.value, decided_seconds_after_kill=round(
                           decided_after, 2), final_status=procrastinate.row(job),
                       events=events, markers=sorted(markers.of(job)))

    def test_effectful_job_is_failed_and_never_rerun(
            self, procrastinate: ProcrastinateFactory, processes: Processes,
            markers: Markers) -> None:
        """The default effect: failed through Procrastinate's finish function, not retried."""
        job = procrastinate.defer("effect.work")
        first = start_worker(processes, procrastinate, markers, "worker-a")
        wait_until(lambda: markers.has(f"{job}-started-0"), "the task to start", process=first)
        first.kill()
        second = start_worker(processes, procrastinate, markers, "worker-b")
        outcome = recover(procrastinate, job, first)
        assert outcome.reason is Reason.WORKER_DIED_MID_STEP
        assert procrastinate.status(job) == "failed"
        # The new worker runs a later job to the end: it has polled past the failed one.
        later = procrastinate.defer("pure.work", {"hang": []})
        wait_until(lambda: procrastinate.status(later) == "completed", "a later job to run",
                   process=second)
        assert markers.of(job) == {"started-0"}
        assert procrastinate.status(job) == "failed"
        assert procrastinate.events(job)[-1] == "failed"

    def test_steps_recorded_in_the_ledger_resume_at_the_first_unstarted_step(
            self, procrastinate: ProcrastinateFactory, processes: Processes,
            markers: Markers) -> None:
        """fetch succeeded, the worker died before charge: the re-run skips fetch."""
        job = procrastinate.defer("ledger.charge", {"hang_after": "fetch"})
        first = start_worker(processes, procrastinate, markers, "worker-a")
        wait_until(lambda: markers.has(f"{job}-step-fetch-0"), "fetch to run", process=first)
        time.sleep(0.2)  # fetch's success is recorded as its block ends
        first.kill()
        second = start_worker(processes, procrastinate, markers, "worker-b")
        outcome = recover(procrastinate, job, first)
        assert (outcome.reason, outcome.resume_step_index) == (
            Reason.RESUMED_FROM_UNSTARTED_STEP, 1)
        wait_until(lambda: procrastinate.status(job) == "completed", "the re-run to finish",
                   process=second)
        assert markers.of(job) == {"pending-0-0,1,2", "step-fetch-0", "pending-1-1,2",
                                   "step-charge-1", "step-notify-1", "done-1"}


class TestLiveWorker:
    """A worker that heartbeats keeps its job, however long the job runs."""

    def test_heartbeating_workers_job_is_never_touched(
            self, procrastinate: ProcrastinateFactory, processes: Processes,
            markers: Markers) -> None:
        """Passes for longer than a session timeout leave it running on the same worker."""
        job = procrastinate.defer("idem.work")
        worker = start_worker(processes, procrastinate, markers, "worker-a")
        wait_until(lambda: markers.has(f"{job}-started-0"), "the task to start", process=worker)
        owner = procrastinate.row(job)
        deadline = time.monotonic() + TIMEOUT_SECONDS + 0.5
        while time.monotonic() < deadline:
            assert reconcile_once(procrastinate.db.engine, procrastinate.config,
                                  KINDS) == []
            time.sleep(0.25)
        assert procrastinate.row(job) == owner
        assert procrastinate.status(job) == "running"
        assert worker.alive()


class TestLateWriter:
    """The old worker SIGSTOPped past the timeout, its job reclaimed, then SIGCONTed."""

    def test_late_finish_and_what_we_guarantee(
            self, procrastinate: ProcrastinateFactory, processes: Processes,
            markers: Markers) -> None:
        """Procrastinate fences a finish on status only: the old worker's late 'succeeded'
        lands on the new worker's running job. Our resume and its event stay recorded."""
        job = procrastinate.defer("idem.work", {"hang": [2.0, 4.0]})
        old = start_worker(processes, procrastinate, markers, "worker-old")
        wait_until(lambda: markers.has(f"{job}-started-0"), "the task to start", process=old)
        old.signal(signal.SIGSTOP)
        new = start_worker(processes, procrastinate, markers, "worker-new")
        outcome = recover(procrastinate, job, old)
        assert outcome.disposition is Disposition.RESUME
        wait_until(lambda: markers.has(f"{job}-started-1"), "the new run to start", process=new)
        old.signal(signal.SIGCONT)
        wait_until(lambda: markers.has(f"{job}-done-0"), "the old run to end", process=old)
        wait_until(lambda: markers.has(f"{job}-done-1"), "the new run to end", process=new)
        time.sleep(0.5)
        facts: dict[str, Any] = {"status_after_both": procrastinate.row(job),
                                 "events": procrastinate.events(job),
                                 "new_worker_error": "not in \"doing\"" in new.output()}
        record_finding("procrastinate", "late_writer", job_id=job, **facts)
        # Ours: the resume happened and Procrastinate's own history keeps it.
        assert "deferred_for_retry" in facts["events"]
        # Theirs, as observed: the old worker's finish won, the new worker's was refused.
        assert facts["status_after_both"]["status"] == "succeeded"
        assert facts["events"][-1] == "succeeded"
        assert facts["new_worker_error"]

    def test_late_step_is_refused_by_the_ledger(
            self, procrastinate: ProcrastinateFactory, processes: Processes,
            markers: Markers) -> None:
        """With the step ledger the old worker cannot run its next step after the reclaim:
        charge (effectful) runs once, on the new worker."""
        job = procrastinate.defer("ledger.charge", {"hang_after": "fetch", "hang": [2.0]})
        old = start_worker(processes, procrastinate, markers, "worker-old")
        wait_until(lambda: markers.has(f"{job}-step-fetch-0"), "fetch to run", process=old)
        time.sleep(0.2)
        old.signal(signal.SIGSTOP)
        new = start_worker(processes, procrastinate, markers, "worker-new")
        outcome = recover(procrastinate, job, old)
        assert outcome.reason is Reason.RESUMED_FROM_UNSTARTED_STEP
        wait_until(lambda: markers.has(f"{job}-done-1"), "the new run to end", process=new)
        old.signal(signal.SIGCONT)
        wait_until(lambda: "LeaseLost" in old.output(), "the old run to be refused",
                   process=old)
        time.sleep(0.5)
        charges = sorted(m for m in markers.of(job) if m.startswith("step-charge"))
        record_finding("procrastinate", "late_writer_with_ledger", job_id=job,
                       charges=charges, status=procrastinate.row(job),
                       events=procrastinate.events(job))
        assert charges == ["step-charge-1"]
        assert procrastinate.status(job) == "completed"
