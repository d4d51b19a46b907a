"""Mutation checks: each peer bug, reproduced on a broken copy of our fence, is caught.

For each bug the same scenario runs twice: on the real code, where every chaos count must
be 0, and with the broken copy from tests/chaos/mutants.py swapped in, where the counts
named in the test must not be. The checks are the chaos harness's (tests/chaos/checks.py),
fed by the same ledger, so a check that could not catch the bug would fail here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from reconciler.config.settings import Settings
from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, PassReport, apply_and_record, plan_change, run_pass
from reconciler.core.vocabulary import Reason
from reconciler.errors import LeaseLost
from reconciler.sidecar.service import Service
from reconciler.storage.engines import create_engine
from reconciler.storage.native_source import NativeSource
from reconciler.storage.schema import upgrade
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import Claim, JobClient, Step, StepContext, Worker
from tests.chaos import mutants
from tests.chaos.checks import CheckReport, jobs_table, run_checks
from tests.chaos.ledger import Ledger, instrument
from tests.conftest import ENGINES, PostgresForTests, database_url
from tests.helpers import sidecar_service
from tests.pg_server import ThrowawayPostgres

pytestmark = pytest.mark.chaos

STALE_AFTER_SECONDS = 0.2
THRESHOLDS = Thresholds(STALE_AFTER_SECONDS, 3600.0)
SHORT_LEASE_SECONDS = 0.3
# A long step outlives the short lease many times over, so the race it opens is won even
# on a slow machine.
LONG_STEP_SECONDS = 2.5
PLAN = (Step("fetch", "idempotent"), Step("publish", "effectful"))
WAIT_SECONDS = 15.0


def wait_for(condition: Callable[[], bool], timeout: float = WAIT_SECONDS) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` passes; whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


class Scene:
    """One database, a ledger folder, instrumented clients and the checks."""

    def __init__(self, url: str, root: Path) -> None:
        self.url = url
        self.ledger_dir = root / "ledger"
        self.engine: Engine = create_engine(url)
        self.store = SqlStore(self.engine)
        self.settings = Settings(database_url=url, poll_interval_seconds=0.05,
                                 retry_backoff_seconds=0.05, retry_backoff_max_seconds=0.1,
                                 artifact_root=str(root / "artifacts"))
        self._clients: list[tuple[JobClient, Ledger]] = []

    def client(self, role: str) -> tuple[JobClient, Ledger]:
        """A JobClient whose writes go to the write log, and its ledger."""
        client = JobClient(self.engine, settings=self.settings)
        ledger = Ledger(self.ledger_dir, role)
        instrument(client.store, ledger)
        self._clients.append((client, ledger))
        return client, ledger

    @staticmethod
    def run_step(claim: Claim, ledger: Ledger, index: int) -> None:
        """One step as the runtime runs it: record start, begin, effect, record finish."""
        kind = claim.steps[index].kind.value
        claim.start_step(index)
        ledger.began(claim.job_id, index, claim.generation, kind)
        ledger.effect(claim.job_id, index, claim.generation, kind)
        claim.finish_step(index)

    def wait_until_stale(self) -> None:
        """Past the short lease and the stale threshold (the database clock is this host's)."""
        time.sleep(SHORT_LEASE_SECONDS + STALE_AFTER_SECONDS + 0.15)

    def reconcile(self) -> PassReport:
        """One real pass."""
        return run_pass(self.store, PassConfig(batch_size=100, thresholds=THRESHOLDS,
                                               instance="mutation-check"))

    def drain(self) -> None:
        """A healthy worker runs every job that can be claimed, to the end."""
        client, ledger = self.client("drain")
        while (claim := client.claim("drainer", lease_seconds=30)) is not None:
            for index in range(claim.next_step_index, len(claim.steps)):
                self.run_step(claim, ledger, index)
            claim.complete()

    def status(self, job_id: int) -> str:
        with self.engine.connect() as conn:
            return str(conn.execute(sa.select(jobs_table.c.job_status)
                                    .where(jobs_table.c.job_id == job_id)).scalar_one())

    def check(self) -> CheckReport:
        report = run_checks(self.engine, self.ledger_dir)
        print(report.render())  # shown with -s: which rule caught the mutation
        return report

    def close(self) -> None:
        for client, ledger in self._clients:
            client.close()
            ledger.close()
        self.engine.dispose()


@pytest.fixture(params=[engine for engine in ENGINES if engine != "mariadb"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path,
           postgres: PostgresForTests | None) -> Iterator[str]:
    """The session's engines but MariaDB: the mutants (tests/chaos/mutants.py) are copies
    of the SQLite and PostgreSQL statements, and what they check, that the chaos checks
    catch each bug, no engine changes."""
    yield from database_url(request, tmp_path, postgres, migrated=True)


@pytest.fixture
def scene(db_url: str, tmp_path: Path) -> Iterator[Scene]:
    """A migrated database on each engine, with a ledger."""
    s = Scene(db_url, tmp_path)
    yield s
    s.close()


def caught(report: CheckReport, *rules: str) -> None:
    """The mutation was caught, by (at least) these rules."""
    assert not report.ok, "the checks missed the mutation:\n" + report.render()
    missing = [rule for rule in rules if report.by_rule.get(rule, 0) == 0]
    assert not missing, f"expected rules {missing} to fire:\n{report.render()}"


# -- River #1302: the rescuer overwrote a job completed after its fetch ---------------------


@pytest.mark.parametrize("mutated", [False, True], ids=["real_swap", "swap_without_evidence"])
def test_river_1302_job_completed_after_the_pass_read_it_stays_completed(
    scene: Scene, monkeypatch: pytest.MonkeyPatch, mutated: bool
) -> None:
    """The pass read a stale job, its worker completed it, then the pass applied.

    In the product the pass's row lock (PostgreSQL) or write lock (SQLite) already closes
    this window; the scenario opens it on purpose, reading and applying in two
    transactions as River's rescuer did, to test the compare-and-swap on its own.
    """
    if mutated:
        monkeypatch.setattr(NativeSource, "_swap", mutants.swap_without_evidence)
    client, ledger = scene.client("worker-a")
    job_id = client.enqueue("mutation", PLAN, max_attempts=3)
    claim = client.claim("worker-a", lease_seconds=SHORT_LEASE_SECONDS)
    assert claim is not None
    scene.run_step(claim, ledger, 0)
    scene.wait_until_stale()

    with scene.store.pass_transaction(dry_run=True) as tx:
        planned = [plan_change(row, THRESHOLDS)
                   for row in tx.jobs.candidates(100, THRESHOLDS, None)]
    assert [(p.decision.job_id, p.decision.reason) for p in planned] == [
        (job_id, Reason.RESUMED_FROM_UNSTARTED_STEP)]
    scene.run_step(claim, ledger, 1)  # the worker was alive after all, and finishes
    claim.complete()
    with scene.store.pass_transaction(dry_run=False) as tx:
        _, recorded = apply_and_record(tx, "rescuer", planned)
    scene.drain()
    report = scene.check()

    if mutated:
        assert recorded[0].reason is Reason.RESUMED_FROM_UNSTARTED_STEP
        caught(report, "stale_generation_writes/completed_attempt_overwritten",
               "stale_generation_writes/decision_on_ended_attempt",
               "effects_repeated/effect_ran_twice")
    else:
        assert recorded[0].reason is Reason.FENCE_LOST
        assert scene.status(job_id) == "completed"
        assert report.ok, report.render()


# -- Solid Queue #589: a finished job later marked failed -----------------------------------


@pytest.mark.parametrize("mutated", [False, True], ids=["real_fence", "fence_without_lease"])
def test_solid_queue_589_stale_worker_cannot_fail_a_finished_job(
    scene: Scene, monkeypatch: pytest.MonkeyPatch, mutated: bool
) -> None:
    """A worker stalls mid step; its job is resumed and completed elsewhere; it then fails."""
    if mutated:
        monkeypatch.setattr(SqlStore, "_fence", mutants.fence_without_lease)
    client, ledger = scene.client("worker-a")
    job_id = client.enqueue("mutation", PLAN, max_attempts=3)
    stale = client.claim("worker-a", lease_seconds=SHORT_LEASE_SECONDS)
    assert stale is not None
    stale.start_step(0)
    ledger.began(job_id, 0, stale.generation, "idempotent")  # ... and the handler stalls
    scene.wait_until_stale()
    assert [d.reason for d in scene.reconcile().decisions] == [Reason.RESUMED_IDEMPOTENT_STEP]
    scene.drain()
    assert scene.status(job_id) == "completed"

    refused = False
    try:  # the stalled handler raises; its worker records the failure as the runtime does
        stale.fail_step(0, "Boom", retryable=False)
        stale.fail("Boom", retryable=False)
    except LeaseLost:
        refused = True
    report = scene.check()

    if mutated:
        assert not refused
        assert scene.status(job_id) == "failed"
        caught(report, "stale_generation_writes/completed_attempt_overwritten",
               "stale_generation_writes/write_after_attempt_ended",
               "unexplained_transitions/final_state_unexplained")
    else:
        assert refused
        assert scene.status(job_id) == "completed"
        assert report.ok, report.render()


# -- Celery #5935: a long task delivered twice -----------------------------------------------


def _long_step_worker(scene: Scene, name: str, *, lease_seconds: float,
                      step_seconds: float) -> Worker:
    client, ledger = scene.client(f"worker-{name}")

    def step(ctx: StepContext) -> None:
        generation = ctx._claim.generation  # see chaos_worker.generation_of
        kind = ctx._claim.steps[ctx.step_index].kind.value
        ledger.began(ctx.job_id, ctx.step_index, generation, kind)
        time.sleep(step_seconds)
        ledger.effect(ctx.job_id, ctx.step_index, generation, kind)

    worker = Worker(client, name, concurrency=1, lease_seconds=lease_seconds,
                    max_run_seconds=30, poll_interval_seconds=0.05,
                    shutdown_grace_seconds=5)
    worker.register("mutation", {"charge": step, "fetch": step, "publish": step})
    return worker


def _heartbeats_unreachable(worker: Worker, seconds: float) -> None:
    """The fault: this worker's heartbeats cannot reach the database for ``seconds``."""
    store: Any = worker.client.store
    beat, until = store.heartbeat, time.monotonic() + seconds

    def heartbeat(*args: Any, **kwargs: Any) -> None:
        if time.monotonic() < until:
            raise sa.exc.OperationalError("UPDATE job_runs", {},
                                          ConnectionError("database unreachable"))
        beat(*args, **kwargs)

    store.heartbeat = heartbeat


def _run_in_thread(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, kwargs={"max_jobs": 1}, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("mutated", [False, True],
                         ids=["real_claim", "claim_redelivering_expired"])
def test_celery_5935_long_task_is_not_delivered_twice(
    scene: Scene, monkeypatch: pytest.MonkeyPatch, mutated: bool
) -> None:
    """A long effectful step outlives its lease (heartbeats fail); another worker polls."""
    if mutated:
        monkeypatch.setattr(SqlStore, "_claim_once", mutants.claim_redelivering_expired)
    first = _long_step_worker(scene, "a", lease_seconds=SHORT_LEASE_SECONDS,
                             step_seconds=LONG_STEP_SECONDS)
    _heartbeats_unreachable(first, seconds=2 * LONG_STEP_SECONDS)
    job_id = first.client.enqueue("mutation", [Step("charge", "effectful")], max_attempts=3)
    first_thread = _run_in_thread(first)
    assert wait_for(lambda: first.stats.claimed == 1)
    second = _long_step_worker(scene, "b", lease_seconds=10.0, step_seconds=0.1)
    second_thread = _run_in_thread(second)
    first_thread.join(WAIT_SECONDS)
    if not wait_for(lambda: second.stats.claimed == 1, timeout=0.5):
        second.stop()
    second_thread.join(WAIT_SECONDS)
    assert not first_thread.is_alive()
    assert not second_thread.is_alive()
    scene.reconcile()
    report = scene.check()

    if mutated:
        caught(report, "effects_repeated/effect_ran_twice")
    else:
        assert second.stats.claimed == 0
        assert scene.status(job_id) == "completed"
        assert report.ok, report.render()


def test_heartbeat_that_never_renews_does_not_duplicate_on_its_own(
    scene: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: with a dead heartbeat, the reconciler and the write fence still hold.

    The lease runs out under a live handler; the reconciler resumes the idempotent step it
    was in, another worker runs the job to the end, and the stale handler's next write is
    refused, so the effectful step after it runs once. (This is why the Celery mutation
    above is the claim: breaking the heartbeat alone costs a retry, not a duplicate.)
    """
    monkeypatch.setattr(SqlStore, "heartbeat", mutants.heartbeat_without_renewal)
    job_id = scene.client("producer")[0].enqueue("mutation", PLAN, max_attempts=3)
    first = _long_step_worker(scene, "a", lease_seconds=SHORT_LEASE_SECONDS,
                             step_seconds=LONG_STEP_SECONDS)
    first_thread = _run_in_thread(first)
    assert wait_for(lambda: first.stats.claimed == 1)
    second = _long_step_worker(scene, "b", lease_seconds=10.0, step_seconds=0.05)
    second_thread = _run_in_thread(second)
    stop = threading.Event()

    def reconcile_until_stopped() -> None:
        while not stop.wait(0.1):
            scene.reconcile()

    reconciler = threading.Thread(target=reconcile_until_stopped, daemon=True)
    reconciler.start()
    try:
        first_thread.join(WAIT_SECONDS)
        second_thread.join(WAIT_SECONDS)
    finally:
        stop.set()
        reconciler.join(WAIT_SECONDS)
    assert first.stats.outcomes == {"lost": 1}
    assert scene.status(job_id) == "completed"
    report = scene.check()
    assert report.ok, report.render()


# -- DBOS #716: a PostgreSQL restart stranded recovery for good -----------------------------


def _failed_passes(service: Service) -> float:
    return service.metrics.registry.get_sample_value(
        "reconciler_passes_total", {"outcome": "error"}) or 0.0


@pytest.mark.parametrize("mutated", [False, True], ids=["real_service", "pass_loop_that_dies"])
def test_dbos_716_service_recovers_jobs_after_a_database_restart(
    own_postgres: ThrowawayPostgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    mutated: bool,
) -> None:
    """PostgreSQL restarts under a running service; a worker dies after it; is it recovered?"""
    if mutated:
        monkeypatch.setattr(Service, "run_one_pass", mutants.pass_loop_that_dies)
    own_postgres.create_database("dbos")
    scene = Scene(own_postgres.url("dbos"), tmp_path)
    upgrade(scene.engine)
    service = sidecar_service(Settings(
        database_url=scene.url, interval_seconds=0.1, stale_after_seconds=STALE_AFTER_SECONDS,
        leader_lease_seconds=1.0, metrics_port=0, artifact_root=str(tmp_path / "artifacts")),
        instance="dbos-716")
    service.start()
    try:
        assert wait_for(lambda: service.last_pass_finished is not None)
        for _ in range(3):  # until a pass has run into the restart
            failures = _failed_passes(service)
            own_postgres.restart(mode="immediate")
            if wait_for(lambda f=failures: _failed_passes(service) > f, timeout=2.0):
                break
        else:
            pytest.fail("no pass ran while the database restarted")

        client, ledger = scene.client("worker-a")
        job_id = client.enqueue("mutation", PLAN, max_attempts=3)
        claim = client.claim("worker-a", lease_seconds=SHORT_LEASE_SECONDS)
        assert claim is not None
        claim.start_step(0)
        ledger.began(job_id, 0, claim.generation, "idempotent")  # ... and the worker dies
        wait_for(lambda: scene.status(job_id) != "processing", timeout=5.0)
        scene.drain()
    finally:
        service.stop()
    report = scene.check()
    scene.close()

    if mutated:
        caught(report, "jobs_lost/not_terminal")
    else:
        assert report.ok, report.render()
