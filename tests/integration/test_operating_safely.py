"""Operating safely (docs/operating.md), on SQLite and PostgreSQL: shadow passes change
nothing and say so, skips are recorded once per job, reason and generation, and a job
whose workers keep dying is quarantined as a crash loop."""

from __future__ import annotations

import signal
from dataclasses import replace

from sqlalchemy.engine import Engine

from reconciler.core.brake import BrakeLimits
from reconciler.core.passes import PassReport, run_pass
from reconciler.core.vocabulary import Disposition, Reason
from reconciler.storage.audit import read_brake
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import JobClient
from tests.conftest import run_forked
from tests.helpers import job_row
from tests.integration.test_pass import (
    EFFECTFUL,
    IDEMPOTENT,
    config,
    crash,
    decisions_for,
    finish,
    gated,
    snapshot,
    wait_expired,
)


def test_a_shadow_pass_records_every_decision_marked_shadow_and_changes_no_job(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """The pass decides as usual, records each decision with shadow_mode set and no
    generation after, and leaves every job, step and attempt exactly as it was."""
    resumable = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0))
    doomed = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0), max_attempts=1)
    before = snapshot(engine)

    report = store_pass(store, shadow=True)

    assert report.shadow
    assert sorted((d.job_id, d.disposition, d.reason) for d in report.decisions) == sorted([
        (resumable.job_id, Disposition.RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP),
        (doomed.job_id, Disposition.TERMINALIZE, Reason.RESUME_EXHAUSTED),
    ])
    after = snapshot(engine)
    for table in ("job_runs", "step_runs", "job_attempts"):
        assert after[table] == before[table], table
    for crashed in (resumable, doomed):
        (stored,) = decisions_for(engine, crashed.job_id)
        assert (stored["shadow_mode"], stored["generation_after"]) == (True, None)

    # Switched on, the same jobs are decided for real, and recorded again (not shadow).
    real = store_pass(store)
    assert not real.shadow
    assert {d.job_id for d in real.decisions if d.disposition is not Disposition.SKIP} == {
        resumable.job_id, doomed.job_id}
    assert [r["shadow_mode"] for r in decisions_for(engine, resumable.job_id)] == [True, False]


def test_a_gated_job_is_recorded_once_then_parked_until_its_worker_writes_again(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """Three passes over a job waiting on a gate leave one waiting_on_gate record, and only
    the first pass even reads it (the later ones are quiet); the gate's worker finishing
    the step brings the job back into the scans."""
    waiting = crash(client, engine, [IDEMPOTENT, EFFECTFUL], gated)

    reports = [store_pass(store) for _ in range(3)]

    assert [[(d.job_id, d.reason) for d in r.decisions] for r in reports] == [
        [(waiting.job_id, Reason.WAITING_ON_GATE)], [], []]
    (stored,) = decisions_for(engine, waiting.job_id)
    assert (stored["decision_reason"], stored["generation_before"]) == (
        "waiting_on_gate", waiting.generation)

    waiting.claim.finish_step(1)  # the gate opened; its worker records it, then dies
    wait_expired(engine, waiting.job_id)
    after_gate = store_pass(store)
    assert [(d.job_id, d.reason) for d in after_gate.decisions] == [
        (waiting.job_id, Reason.COMPLETION_RECOVERED)]


def test_held_jobs_are_recorded_once_and_unholding_brings_them_back(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """A batch of held stale jobs does not fill every batch: each is recorded held once,
    the next passes find the unheld stale job at once, and an unhold lets the pass
    decide a held job again."""
    held = [crash(client, engine, [IDEMPOTENT], wait=False) for _ in range(4)]
    for h in held:
        assert store.operator_action(h.job_id, "hold") == (True, None)
    loose = crash(client, engine, [IDEMPOTENT])
    wait_expired(engine, *(h.job_id for h in held))
    small_batches = replace(config(batch_size=4))

    first = run_pass(store, small_batches)
    second = run_pass(store, small_batches)

    assert {(d.job_id, d.reason) for d in first.decisions} == {
        (h.job_id, Reason.OPERATOR_HOLD) for h in held}
    assert [(d.job_id, d.reason) for d in second.decisions] == [
        (loose.job_id, Reason.RESUMED_FROM_UNSTARTED_STEP)]
    assert run_pass(store, small_batches).decisions == ()

    assert store.operator_action(held[0].job_id, "unhold") == (True, None)
    after_unhold = run_pass(store, small_batches)
    assert [(d.job_id, d.reason) for d in after_unhold.decisions] == [
        (held[0].job_id, Reason.RESUMED_FROM_UNSTARTED_STEP)]
    assert [r["decision_reason"] for r in decisions_for(engine, held[1].job_id)] == [
        "operator_hold"]


def store_pass(store: SqlStore, *, shadow: bool = False) -> PassReport:
    """One pass of the suite's configuration, optionally in shadow mode."""
    return run_pass(store, replace(config(), shadow=shadow))


POISON_WORKER = """
import os, signal, sys
from reconciler.worker import JobClient
client = JobClient(sys.argv[1])
claim = client.claim(worker="victim", lease_seconds=0.3)
assert claim is not None, "nothing to claim"
claim.start_step(claim.next_step_index)  # the poison: this step kills its process
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_job_that_kills_every_worker_that_runs_it_is_quarantined_as_a_crash_loop(
    db_url: str, client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """Two real worker processes in a row are SIGKILLed by the same idempotent step: the
    first death is resumed, the second ends the job failed crash_loop (budget left), so it
    takes no third worker down with it."""
    job_id = client.enqueue("poison", steps=[IDEMPOTENT], max_attempts=5)
    looping = replace(config(), thresholds=replace(config().thresholds, crash_loop_after=2))
    reasons = []
    for _ in range(2):
        died = run_forked(POISON_WORKER, db_url)
        assert died.returncode == -signal.SIGKILL, died.stderr
        wait_expired(engine, job_id)
        report = run_pass(store, looping)
        reasons += [d.reason for d in report.decisions if d.job_id == job_id]

    assert reasons == [Reason.RESUMED_IDEMPOTENT_STEP, Reason.CRASH_LOOP]
    row = job_row(engine, job_id)
    assert (row["job_status"], row["status_reason"], row["attempt_count"]) == (
        "failed", "crash_loop", 2)
    assert client.claim("third-victim", lease_seconds=5) is None


def test_a_database_outage_brakes_the_pass_and_live_workers_carry_on_after(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """Twenty-five workers alive but cut off from the database past their leases: the pass
    finds them all stale at once, brakes (every change becomes skip mass_staleness_brake,
    no job changes), and when the database is back the workers heartbeat and finish."""
    claims = []
    for n in range(25):
        client.enqueue("report", steps=[IDEMPOTENT], max_attempts=3)
        claim = client.claim(f"worker-{n}", lease_seconds=0.3)
        assert claim is not None
        claim.start_step(0)
        claims.append(claim)
    wait_expired(engine, *(c.job_id for c in claims))  # the outage: no heartbeat lands
    before = snapshot(engine)
    limits = BrakeLimits(min_jobs=20, stale_fraction=0.5, hold_seconds=120)

    braked = run_pass(store, replace(config(), brake=limits))

    assert braked.braked
    assert {(d.disposition, d.reason) for d in braked.decisions} == {
        (Disposition.SKIP, Reason.MASS_STALENESS_BRAKE)}
    assert len(braked.decisions) == 25
    for table in ("job_runs", "step_runs", "job_attempts"):
        assert snapshot(engine)[table] == before[table], table
    # Still within the hold: a second pass brakes too, from the same recorded start.
    assert run_pass(store, replace(config(), brake=limits)).braked

    for claim in claims:  # the database is back: the same claims still hold their jobs
        claim.heartbeat()
        claim.finish_step(0)
        claim.complete()
    assert {job_row(engine, c.job_id)["job_status"] for c in claims} == {"completed"}
    quiet = run_pass(store, replace(config(), brake=limits))
    assert (quiet.braked, quiet.decisions) == (False, ())
    # The event is over: the next outage brakes afresh, however long after this one.
    with engine.connect() as conn:
        assert read_brake(conn)[0] is None
