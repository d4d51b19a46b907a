"""The sidecar's own logic without a database: its tick, readiness, overruns and chores.

The service takes its parts, so here they are plain stand-ins: a pass function that
returns scripted reports, a database check that answers as told, and a pass store that
only records the service's calls on it (no SQL is imitated: the store's behaviour is
tested against real databases in tests/integration).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import generate_latest

from reconciler.config.settings import Settings
from reconciler.core.decisions import Thresholds
from reconciler.core.job_retention import RetentionReport
from reconciler.core.passes import PassConfig, PassReport
from reconciler.core.ports import (
    Cursor,
    LivenessUnknown,
    PassUnit,
    RecordedDecision,
    StuckCount,
    StuckWork,
)
from reconciler.core.vocabulary import (
    Disposition,
    LivenessDoubt,
    PassOutcome,
    Reason,
    StuckReason,
)
from reconciler.errors import DatabaseUnavailableError, SchemaOutOfDateError
from reconciler.sidecar.parts import DatabaseCheck, ErrorReading, SidecarParts
from reconciler.sidecar.service import TICK_CHORE, TICK_MAX_BATCHES, Service
from reconciler.storage.diagnosis import error_code, error_line
from tests.helpers import wait_for

BATCH = 3
RESUMED = RecordedDecision(1, Disposition.RESUME, Reason.RESUMED_IDEMPOTENT_STEP, 0, 1, 2)
HELD = RecordedDecision(2, Disposition.SKIP, Reason.OPERATOR_HOLD, None, 1, None)
LATER = timedelta(hours=1)


def report(*decisions: RecordedDecision, next_cursor: Cursor | None = None) -> PassReport:
    return PassReport(7, PassOutcome.OK, decisions, next_cursor)


class Recorder:
    """A pass store, artifact records and job retention that record what they were asked."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.leader = True
        self.running = 10
        """Running jobs: more than the stuck ones, so some worker is alive."""

    def pass_transaction(self, *, dry_run: bool) -> AbstractContextManager[PassUnit]:
        raise AssertionError("the service's passes go through the pass function")

    def record_failed_pass(self, instance: str, error_code: str) -> int:
        self.calls.append(f"record_failed_pass {error_code}")
        return 1

    def release_leadership(self, lease_name: str, holder_id: str) -> None:
        self.calls.append("release_leadership")

    def try_lead(self, lease_name: str, holder_id: str, ttl_seconds: float) -> int | None:
        return 1 if self.leader else None

    def stuck_work(self) -> StuckWork:
        return {StuckReason.AWAITING_DECISION: StuckCount(4, 12.5),
                StuckReason.UNDECIDABLE: StuckCount(2)}

    def backlog(self) -> tuple[StuckWork, int]:
        return self.stuck_work(), self.running


    def delete_audit_before(self, days: float, limit: int) -> int:
        self.calls.append("delete_audit_before")
        return 0

    def delete_finished_jobs(self, days: float, batch_jobs: int,
                             max_batches: int) -> RetentionReport:
        self.calls.append("delete_finished_jobs")
        return RetentionReport(0, 0, 1)

    def unpublishable_artifacts(self, limit: int) -> list[tuple[int, int, str]]:
        self.calls.append("artifact_sweep")
        return []

    def unsettled_published_artifacts(self, limit: int) -> list[tuple[int, int, str]]:
        return []

    def published_artifact_names(self, job_id: int, generation: int) -> list[str]:
        return []

    def settle_artifacts(self, job_id: int, generation: int) -> None:
        return None

    def discard_artifact(self, job_id: int, generation: int, artifact_name: str) -> bool:
        return True


class Scripted:
    """A pass function returning the given reports (or raising the given errors) in turn."""

    def __init__(self, *outcomes: PassReport | Exception) -> None:
        self.outcomes = list(outcomes)
        self.cursors: list[Cursor | None] = []

    def __call__(self, store: Any, config: PassConfig, *, after: Cursor | None = None
                 ) -> PassReport:
        self.cursors.append(after)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


class Database:
    """The database check: answers as ``failure`` says (None: ready)."""

    def __init__(self) -> None:
        self.failure: Exception | None = None

    def run(self) -> None:
        if self.failure is not None:
            raise self.failure


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def database() -> Database:
    return Database()


@pytest.fixture
def make_service(recorder: Recorder, database: Database) -> Iterator[Any]:
    """Services on stand-in parts; each is closed at teardown."""
    made: list[Service] = []

    def make(*outcomes: PassReport | Exception, **settings: Any) -> Service:
        values: dict[str, Any] = {"interval_seconds": 30.0, "leader_lease_seconds": 90.0,
                                  **settings}
        parts = SidecarParts(
            settings=Settings(**values), instance="unit",
            pass_config=PassConfig(batch_size=BATCH, thresholds=Thresholds(60.0, 3600.0),
                                   instance="unit"),
            passes=recorder, artifacts=recorder, job_retention=recorder,
            database_check=DatabaseCheck(database.run, lambda: None),
            errors=ErrorReading(error_code, error_line), console=None,
            close=lambda: None)
        service = Service(parts, run=Scripted(*outcomes))
        service.probe.fresh_seconds = 0.0  # every readiness call checks again
        made.append(service)
        return service

    yield make
    for service in made:
        service.close()


def metric(service: Service, name: str) -> str:
    lines = generate_latest(service.metrics.registry).decode().splitlines()
    return next(line for line in lines if line.startswith(name + " "))


def full() -> PassReport:
    """A full batch that resumed every job in it."""
    return report(*[RESUMED] * BATCH)


class TestTick:
    """A tick runs batches back to back while they come back full and make progress."""

    def test_full_batches_that_resume_jobs_run_back_to_back_until_a_short_one(
            self, make_service: Any) -> None:
        """Two full batches, then a short one: one tick, three passes."""
        service = make_service(report(RESUMED, RESUMED, RESUMED),
                               report(RESUMED, RESUMED, RESUMED), report(RESUMED))
        assert len(service.run_tick()) == 3
        assert not service.backlog_left

    def test_a_tick_stops_at_its_batch_limit_with_the_backlog_left(
            self, make_service: Any) -> None:
        """Full batches beyond the limit are left to the next tick, and it says so."""
        service = make_service(*[full() for _ in range(TICK_MAX_BATCHES + 1)], report())
        assert len(service.run_tick()) == TICK_MAX_BATCHES
        assert service.backlog_left
        assert len(service.run_tick()) == 2
        assert not service.backlog_left

    def test_a_full_batch_of_skips_with_nowhere_to_page_ends_the_tick(
            self, make_service: Any) -> None:
        """Held jobs filling a batch would only repeat: the next tick tries again."""
        service = make_service(report(HELD, HELD, HELD), report(HELD))
        assert len(service.run_tick()) == 1
        assert not service.backlog_left

    def test_a_full_batch_of_skips_with_a_cursor_pages_on_from_it(
            self, make_service: Any) -> None:
        """The next batch starts where the last one left off."""
        cursor = Cursor(("3",))
        scripted_service = make_service(report(HELD, HELD, HELD, next_cursor=cursor),
                                        report())
        assert len(scripted_service.run_tick()) == 2
        assert scripted_service._run_pass.cursors == [None, cursor]

    def test_a_stop_ends_the_tick_after_the_batch_in_flight(self, make_service: Any) -> None:
        """SIGTERM does not wait for the backlog to drain."""
        service = make_service(report(RESUMED, RESUMED, RESUMED), report())
        service.stopping.set()
        assert len(service.run_tick()) == 1
        assert not service.backlog_left

    def test_a_failed_pass_is_counted_recorded_and_never_raised(
            self, make_service: Any, recorder: Recorder) -> None:
        """A database that answered with an error gets an error pass row; the tick ends."""
        service = make_service(SchemaOutOfDateError("the schema is at 0005"))
        assert service.run_tick() == []
        assert service.last_pass_failure is not None
        assert recorder.calls == ["record_failed_pass schema_mismatch"]
        assert metric(service, 'reconciler_passes_total{outcome="error"}').endswith("1.0")

    def test_a_database_that_cannot_be_reached_is_not_written_to_about_it(
            self, make_service: Any, recorder: Recorder) -> None:
        """Recording the failure there would only wait again: the metric carries it."""
        service = make_service(DatabaseUnavailableError("cannot reach the database"))
        assert service.run_tick() == []
        assert recorder.calls == []
        assert metric(service, 'reconciler_pass_errors_total{code="unreachable"}').endswith(
            "1.0")


class TestNextTick:
    """A tick that stopped with backlog left is followed by the next at once; any other
    keeps the interval (the scheduler is APScheduler's own, started paused)."""

    @pytest.fixture
    def paused(self) -> Iterator[list[Service]]:
        """Services whose scheduler holds the pass an hour ahead; shut down at teardown."""
        services: list[Service] = []
        yield services
        for service in services:
            service.scheduler.shutdown(wait=False)

    @staticmethod
    def schedule_paused(service: Service, paused: list[Service]) -> None:
        service.scheduler.add_job(service.run_tick, "interval", id=TICK_CHORE,
                                  seconds=service.settings.interval_seconds,
                                  next_run_time=datetime.now(UTC) + LATER)
        service.scheduler.start(paused=True)
        paused.append(service)

    @staticmethod
    def next_run(service: Service) -> datetime:
        job = service.scheduler.get_job(TICK_CHORE)
        assert job is not None
        return job.next_run_time  # type: ignore[no-any-return]

    def test_backlog_left_brings_the_next_tick_forward_to_now(
            self, make_service: Any, paused: list[Service]) -> None:
        service = make_service(*[full() for _ in range(TICK_MAX_BATCHES)])
        self.schedule_paused(service, paused)
        service.run_tick()
        service.next_tick_at_once()
        assert self.next_run(service) <= datetime.now(UTC)

    @pytest.mark.parametrize("last", [
        report(RESUMED), report(HELD, HELD, HELD), SchemaOutOfDateError("at 0005")],
        ids=["short batch", "full batch of held jobs", "failed pass"])
    def test_a_tick_that_ends_any_other_way_keeps_the_interval(
            self, make_service: Any, paused: list[Service],
            last: PassReport | Exception) -> None:
        service = make_service(full(), last)
        self.schedule_paused(service, paused)
        service.run_tick()
        service.next_tick_at_once()
        assert self.next_run(service) > datetime.now(UTC) + LATER / 2

    def test_a_stopping_service_starts_no_tick_at_once(
            self, make_service: Any, paused: list[Service]) -> None:
        service = make_service(*[full() for _ in range(TICK_MAX_BATCHES)])
        self.schedule_paused(service, paused)
        service.run_tick()
        service.stopping.set()
        service.next_tick_at_once()
        assert self.next_run(service) > datetime.now(UTC) + LATER / 2

    def test_a_backlog_of_several_ticks_runs_without_waiting_for_the_interval(
            self, make_service: Any) -> None:
        """The running service, interval 30 s: two and a half ticks' worth of full
        batches run as three ticks, one after another, long before a second fire."""
        batches = [full() for _ in range(2 * TICK_MAX_BATCHES + 5)]
        service = make_service(*batches, report(), interval_seconds=30.0, metrics_port=0)
        service.start()
        try:
            wait_for(lambda: not service._run_pass.outcomes, "every batch to run", 10.0)
            wait_for(lambda: metric(service, "reconciler_tick_batches_count") == (
                "reconciler_tick_batches_count 3.0"), "the third tick to finish", 10.0)
        finally:
            service.stop()
        assert metric(service, "reconciler_tick_batches_sum").endswith(
            f" {2 * TICK_MAX_BATCHES + 6}.0")
        assert metric(service, "reconciler_pass_overruns_total").endswith(" 0.0")


class TestReadiness:
    """/readyz: the database check answers, and a pass finished lately."""

    def test_not_ready_until_a_pass_finished_then_ready(self, make_service: Any) -> None:
        service = make_service(report())
        assert service.readiness() == (False, "no pass has finished yet")
        service.run_one_pass()
        assert service.readiness() == (True, "ready")

    def test_the_database_checks_answer_is_the_reason(self, make_service: Any,
                                                       database: Database) -> None:
        """The check's one line (the start-up check's) is what /readyz says."""
        service = make_service(report())
        service.run_one_pass()
        database.failure = SchemaOutOfDateError("the schema is at 0005; run db upgrade")
        assert service.readiness() == (False, "the schema is at 0005; run db upgrade")

    def test_a_failed_last_pass_is_not_ready(self, make_service: Any) -> None:
        service = make_service(report(), DatabaseUnavailableError("gone"))
        service.run_one_pass()
        service.run_one_pass()
        ready, why = service.readiness()
        assert not ready
        assert why.startswith("the last pass failed (")

    def test_a_pass_too_long_ago_is_not_ready(self, make_service: Any) -> None:
        """Three intervals and ten seconds without a finished pass: not ready."""
        service = make_service(report(), interval_seconds=1.0)
        service.run_one_pass()
        service.last_pass_finished = time.monotonic() - 14.0
        ready, why = service.readiness()
        assert (ready, why) == (False, "last successful pass 14s ago")


class TestOverrunsAndChores:
    """What the scheduler runs is a declared list; a skipped tick is counted."""

    def test_a_skipped_tick_is_counted_and_a_skipped_chore_is_not(
            self, make_service: Any) -> None:
        service = make_service()
        service.observe_overrun("pass")
        service.observe_overrun("backlog")
        assert metric(service, "reconciler_pass_overruns_total").endswith("1.0")

    def test_the_chores_are_declared_once_with_their_periods_and_leaders(
            self, make_service: Any) -> None:
        service = make_service(interval_seconds=30.0, leader_lease_seconds=90.0)
        declared = {c.name: (c.period_seconds, c.leader_only) for c in service.chores()}
        assert declared == {
            "pass": (30.0, False), "leadership": (30.0, False), "health": (5.0, False),
            "backlog": (15.0, False), "artifacts": (30.0, True),
            "retention": (600.0, True), "job_retention": (600.0, True)}

    def test_leader_only_chores_run_only_on_the_leader(
            self, make_service: Any, recorder: Recorder) -> None:
        service = make_service()
        recorder.leader = False
        service.renew_leadership()
        for name in ("artifacts", "retention", "job_retention"):
            service.run_chore(name)
        assert recorder.calls == []
        recorder.leader = True
        service.renew_leadership()
        for name in ("artifacts", "retention", "job_retention"):
            service.run_chore(name)
        assert recorder.calls == ["artifact_sweep", "delete_audit_before",
                                  "delete_finished_jobs"]

    def test_the_backlog_chore_sets_the_gauges_on_every_replica(
            self, make_service: Any, recorder: Recorder) -> None:
        service = make_service()
        recorder.leader = False
        service.run_chore("backlog")
        stale = 'reconciler_stale_claims{reason="%s"}'
        oldest = 'reconciler_oldest_stale_claim_age_seconds{reason="%s"}'
        assert metric(service, stale % "awaiting_decision").endswith(" 4.0")
        assert metric(service, oldest % "awaiting_decision").endswith(" 12.5")
        assert metric(service, stale % "undecidable").endswith(" 2.0")
        assert metric(service, stale % "mass_staleness_brake").endswith(" 0.0")
        assert metric(service, "reconciler_no_live_workers").endswith(" 0.0")
        recorder.running = 6  # every running job is stuck: no worker is alive
        service.run_chore("backlog")
        assert metric(service, "reconciler_no_live_workers").endswith(" 1.0")

    def test_jobs_the_last_tick_held_back_are_counted_by_why(
            self, make_service: Any) -> None:
        """Expired jobs the last tick braked are stuck for the brake, not awaiting."""
        braked = dataclasses.replace(report(*[
            RecordedDecision(i, Disposition.SKIP, Reason.MASS_STALENESS_BRAKE, None, 1, None)
            for i in range(2)]), held={StuckReason.MASS_STALENESS_BRAKE: StuckCount(3, 30.0)})
        service = make_service(braked)
        service.run_tick()
        service.run_chore("backlog")
        stale = 'reconciler_stale_claims{reason="%s"}'
        assert metric(service, stale % "awaiting_decision").endswith(" 1.0")
        assert metric(service, stale % "mass_staleness_brake").endswith(" 3.0")
        assert metric(service, 'reconciler_oldest_stale_claim_age_seconds'
                      '{reason="mass_staleness_brake"}').endswith(" 30.0")

    def test_a_probe_that_fails_ends_leadership_at_once(
            self, make_service: Any, database: Database) -> None:
        service = make_service()
        service.renew_leadership()
        assert service.leading
        database.failure = DatabaseUnavailableError("cannot reach the database")
        service.run_chore("health")
        assert not service.leading


class TestLivenessUnknown:
    """A pass whose source doubted its liveness: said once, on /readyz and the metric."""

    BROKER = "redis://:s3cret@127.0.0.1:6390/1"

    def doubted(self, code: LivenessDoubt) -> PassReport:
        return PassReport(7, PassOutcome.LIVENESS_UNKNOWN, (),
                          liveness=LivenessUnknown(code, self.BROKER))

    def test_the_state_flips_and_flips_back_with_one_line_each_way(
            self, make_service: Any, caplog: pytest.LogCaptureFixture) -> None:
        unreachable = self.doubted(LivenessDoubt.BROKER_UNREACHABLE)
        service = make_service(report(), unreachable, unreachable,
                               self.doubted(LivenessDoubt.QUEUES_MISSING), report())
        code = 'reconciler_liveness_unknown{code="%s"}'
        caplog.set_level(logging.INFO, logger="reconciler.sidecar.service")
        service.run_one_pass()
        assert service.readiness() == (True, "ready")
        service.run_one_pass()
        service.run_one_pass()
        ready, why = service.readiness()
        assert not ready, why
        assert "broker_unreachable" in why, why
        assert "s3cret" not in why, why
        assert metric(service, code % "broker_unreachable").endswith(" 1.0")
        assert metric(service, 'reconciler_passes_total{outcome="liveness_unknown"}'
                      ).endswith(" 2.0")
        service.run_one_pass()
        assert metric(service, code % "broker_unreachable").endswith(" 0.0")
        assert metric(service, code % "queues_missing").endswith(" 1.0")
        service.run_one_pass()
        assert service.readiness() == (True, "ready")
        assert metric(service, code % "queues_missing").endswith(" 0.0")
        events = [r.getMessage().split()[0] for r in caplog.records
                  if r.getMessage().startswith("event=liveness")]
        assert events == ["event=liveness_unknown", "event=liveness_unknown",
                          "event=liveness_restored"], events
        assert not any("s3cret" in r.getMessage() for r in caplog.records)
