"""Operator actions: ``reconciler jobs hold|unhold|retry|cancel ID`` and ``store.operator_action``.

Every test runs on SQLite and on PostgreSQL. Actions go through the real CLI process or the
store; the workers they act on are real claims and real ``Worker`` loops; "nothing changed"
and "writes nothing" are checked against full snapshots of the job's rows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import JobArtifact, JobAttempt, JobRun, OperatorAction, StepRun
from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, PassReport, run_pass
from reconciler.core.vocabulary import Disposition, Reason
from reconciler.storage.clock import db_now
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import Claim, JobClient, LeaseLost, Step, Worker
from reconciler.worker.runtime import StepContext, WorkerStats
from tests.conftest import run_cli
from tests.helpers import job_row, rows_of, wait_for

JOBS = cast(sa.Table, JobRun.__table__)
STEP_RUNS = cast(sa.Table, StepRun.__table__)
ATTEMPTS = cast(sa.Table, JobAttempt.__table__)
ARTIFACTS = cast(sa.Table, JobArtifact.__table__)
ACTIONS = cast(sa.Table, OperatorAction.__table__)

PLAN = (Step("fetch", "idempotent"), Step("render", "pure"), Step("publish", "effectful"))
RECONCILE_NOW = Thresholds(stale_after_seconds=0, wedged_after_seconds=3600)
DEADLINE_SECONDS = 15.0
REFUSED_EXIT = 6


def snapshot(engine: Engine, job_id: int) -> dict[str, Any]:
    """Everything a worker may write about one job: job, steps, attempts, artifacts."""
    return {
        "job": job_row(engine, job_id),
        "steps": rows_of(engine, STEP_RUNS, STEP_RUNS.c.job_id == job_id,
                         order=STEP_RUNS.c.step_index),
        "attempts": rows_of(engine, ATTEMPTS, ATTEMPTS.c.job_id == job_id,
                            order=ATTEMPTS.c.claim_generation),
        "artifacts": rows_of(engine, ARTIFACTS, ARTIFACTS.c.job_id == job_id,
                             order=ARTIFACTS.c.claim_generation),
    }


def actions_of(engine: Engine, job_id: int) -> list[tuple[Any, ...]]:
    """The job's recorded operator actions, oldest first, as comparable tuples."""
    return [
        (a["operator_action"], a["action_outcome"], a["refusal_reason"], a["status_before"],
         a["status_after"], a["generation_before"], a["generation_after"])
        for a in rows_of(engine, ACTIONS, ACTIONS.c.job_id == job_id,
                         order=ACTIONS.c.action_id)
    ]


def reconcile(engine: Engine) -> PassReport:
    """One real pass that judges every expired lease at once."""
    config = PassConfig(batch_size=100, thresholds=RECONCILE_NOW, instance="operator-tests")
    return run_pass(SqlStore(engine), config)


def wait_until_expired(engine: Engine, job_id: int) -> None:
    """Wait until the job's lease has expired by the database's clock."""
    def expired() -> bool:
        with engine.connect() as conn:
            return bool(conn.execute(
                sa.select(JOBS.c.lease_expires_at <= db_now())
                .where(JOBS.c.job_id == job_id)).scalar_one())
    wait_for(expired, f"job {job_id}'s lease to expire")


def cli_action(db_url: str, action: str, job_id: int) -> tuple[int, str, str]:
    """Run ``reconciler jobs ACTION ID``; (exit code, stdout, stderr)."""
    note = ["--note", "checked by the test"] if action in ("retry", "cancel") else []
    done = run_cli(db_url, "jobs", action, str(job_id), *note)
    return done.returncode, done.stdout, done.stderr


def assert_applied(done: tuple[int, str, str], action: str, job_id: int) -> None:
    """The CLI applied the action and said so in one line."""
    code, out, err = done
    assert code == 0, err
    assert out.strip().splitlines() == [out.strip()]
    assert f"job {job_id}: {action} applied" in out


def assert_refused(done: tuple[int, str, str], action: str, job_id: int, reason: str) -> None:
    """The CLI refused with a non-zero exit and one line naming the reason, no traceback."""
    code, out, err = done
    assert code == REFUSED_EXIT
    assert out == ""
    assert err.strip().splitlines() == [f"reconciler: error: cannot {action} job {job_id}: "
                                        f"{reason}"]


def claim_job(client: JobClient, job_id: int, lease_seconds: float = 30) -> Claim:
    """Claim the given job (the only one available)."""
    claim = client.claim("host-a:1", lease_seconds=lease_seconds)
    assert claim is not None
    assert claim.job_id == job_id
    return claim


# -- hold and unhold -------------------------------------------------------------------------


def test_hold_keeps_a_queued_job_from_being_claimed_and_unhold_reverses_it(
    client: JobClient, engine: Engine, db_url: str
) -> None:
    """A held queued job is never claimed; after ``jobs unhold`` it is claimed as usual."""
    job_id = client.enqueue("report", steps=PLAN)
    generation = job_row(engine, job_id)["claim_generation"]
    assert_applied(cli_action(db_url, "hold", job_id), "hold", job_id)
    assert job_row(engine, job_id)["operator_hold"] is True
    assert client.claim("host-a:1", lease_seconds=5) is None
    assert job_row(engine, job_id)["job_status"] == "queued"

    assert_applied(cli_action(db_url, "unhold", job_id), "unhold", job_id)
    assert job_row(engine, job_id)["operator_hold"] is False
    claim_job(client, job_id)
    assert actions_of(engine, job_id) == [
        ("hold", "applied", None, "queued", "queued", generation, generation),
        ("unhold", "applied", None, "queued", "queued", generation, generation),
    ]


def test_pass_skips_a_held_stale_processing_job_until_it_is_unheld(
    client: JobClient, engine: Engine
) -> None:
    """A held job whose worker died is skipped with operator_hold (and parked: nothing else
    about it changes); unheld, it is resumed."""
    job_id = client.enqueue("report", steps=PLAN)
    claim = claim_job(client, job_id, lease_seconds=0.2)
    claim.start_step(0)
    claim.finish_step(0)
    assert client.store.operator_action(job_id, "hold") == (True, None)
    wait_until_expired(engine, job_id)
    before = snapshot(engine, job_id)

    report = reconcile(engine)
    assert [(d.job_id, d.disposition, d.reason) for d in report.decisions] == [
        (job_id, Disposition.SKIP, Reason.OPERATOR_HOLD)]
    after = snapshot(engine, job_id)
    assert after["job"].pop("reconcile_parked") is True
    before["job"].pop("reconcile_parked")
    assert after == before

    assert client.store.operator_action(job_id, "unhold") == (True, None)
    report = reconcile(engine)
    assert [(d.job_id, d.disposition, d.reason, d.resume_step_index)
            for d in report.decisions] == [
        (job_id, Disposition.RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP, 1)]
    assert job_row(engine, job_id)["job_status"] == "queued"


def test_hold_twice_and_actions_on_finished_jobs_are_refused_and_recorded(
    client: JobClient, engine: Engine
) -> None:
    """Refusals change nothing, say why, and are recorded like applied actions."""
    job_id = client.enqueue("report", steps=PLAN)
    assert client.store.operator_action(job_id, "hold") == (True, None)
    assert client.store.operator_action(job_id, "hold") == (False, "already_held")
    assert client.store.operator_action(job_id, "unhold") == (True, None)
    assert client.store.operator_action(job_id, "unhold") == (False, "not_held")
    claim_job(client, job_id).complete()
    generation = job_row(engine, job_id)["claim_generation"]
    before = snapshot(engine, job_id)
    for action in ("hold", "cancel"):
        assert client.store.operator_action(job_id, action) == (False, "job_terminal")
    # Not held: nothing to lift (a hold still on it would be lifted, ended or not).
    assert client.store.operator_action(job_id, "unhold") == (False, "not_held")
    assert client.store.operator_action(job_id, "retry") == (False,
                                                              "job_not_failed_or_cancelled")
    assert snapshot(engine, job_id) == before
    assert actions_of(engine, job_id)[-4:] == [
        (action, "refused", reason, "completed", "completed", generation, generation)
        for action, reason in (("hold", "job_terminal"), ("cancel", "job_terminal"),
                               ("unhold", "not_held"),
                               ("retry", "job_not_failed_or_cancelled"))
    ]
    assert [a[:3] for a in actions_of(engine, job_id)[:4]] == [
        ("hold", "applied", None), ("hold", "refused", "already_held"),
        ("unhold", "applied", None), ("unhold", "refused", "not_held")]


# -- retry -----------------------------------------------------------------------------------


def test_retry_of_a_processing_job_is_refused_and_changes_nothing(
    client: JobClient, engine: Engine, db_url: str
) -> None:
    """``jobs retry`` never rewinds a running job: non-zero exit, one line, rows untouched."""
    job_id = client.enqueue("report", steps=PLAN)
    claim = claim_job(client, job_id)
    claim.start_step(0)
    before = snapshot(engine, job_id)
    generation = before["job"]["claim_generation"]

    assert_refused(cli_action(db_url, "retry", job_id), "retry", job_id,
                   "job_not_failed_or_cancelled")
    assert client.store.operator_action(job_id, "retry") == (False,
                                                              "job_not_failed_or_cancelled")
    assert snapshot(engine, job_id) == before
    assert actions_of(engine, job_id) == [
        ("retry", "refused", "job_not_failed_or_cancelled", "processing", "processing",
         generation, generation)] * 2
    # The worker's claim is intact.
    claim.heartbeat()
    claim.finish_step(0)


def test_retry_of_a_failed_job_requeues_it_with_a_fresh_budget(
    client: JobClient, engine: Engine, db_url: str
) -> None:
    """A job that spent its budget is requeued by ``jobs retry`` with every attempt back."""
    job_id = client.enqueue("report", steps=PLAN, max_attempts=2)
    first = claim_job(client, job_id)
    first.start_step(0)
    first.finish_step(0)
    assert first.fail("Timeout", retryable=True) is True
    second = wait_for(lambda: client.claim("host-a:1", lease_seconds=30), "the retry")
    assert second.fail("Timeout", retryable=True) is False
    failed = job_row(engine, job_id)
    assert (failed["job_status"], failed["status_reason"], failed["attempt_count"]) == (
        "failed", "retries_exhausted", 2)

    assert_applied(cli_action(db_url, "retry", job_id), "retry", job_id)
    row = job_row(engine, job_id)
    assert (row["job_status"], row["status_reason"], row["attempt_count"],
            row["resume_step_index"], row["finished_at"]) == (
        "queued", "operator_retry", 0, 1, None)
    assert row["claim_generation"] == failed["claim_generation"] + 1
    assert actions_of(engine, job_id) == [
        ("retry", "applied", None, "failed", "queued", failed["claim_generation"],
         failed["claim_generation"] + 1)]
    # A fresh budget: two more attempts, the first of them a retryable failure again.
    third = claim_job(client, job_id)
    assert third.attempt == 1
    assert third.next_step_index == 1
    assert third.fail("Timeout", retryable=True) is True
    fourth = wait_for(lambda: client.claim("host-a:1", lease_seconds=30), "the retry")
    fourth.complete()
    assert job_row(engine, job_id)["job_status"] == "completed"


# -- cancel ----------------------------------------------------------------------------------


def test_cancel_of_a_queued_job_cancels_it_at_once(
    client: JobClient, engine: Engine, db_url: str
) -> None:
    """``jobs cancel`` on a queued job ends it cancelled; no worker ever claims it."""
    job_id = client.enqueue("report", steps=PLAN)
    assert_applied(cli_action(db_url, "cancel", job_id), "cancel", job_id)
    row = job_row(engine, job_id)
    assert (row["job_status"], row["status_reason"]) == ("cancelled", "operator_cancel")
    assert row["finished_at"] is not None
    assert client.claim("host-a:1", lease_seconds=5) is None
    assert_refused(cli_action(db_url, "cancel", job_id), "cancel", job_id, "job_terminal")
    assert [a[:3] for a in actions_of(engine, job_id)] == [
        ("cancel", "applied", None), ("cancel", "refused", "job_terminal")]


def test_cancel_of_a_processing_job_fences_its_claim_out(
    client: JobClient, engine: Engine, db_url: str
) -> None:
    """After ``jobs cancel`` every write of the running claim raises LeaseLost, changing nothing."""
    job_id = client.enqueue("report", steps=PLAN)
    claim = claim_job(client, job_id)
    claim.start_step(0)
    generation = claim.generation

    assert_applied(cli_action(db_url, "cancel", job_id), "cancel", job_id)
    after_cancel = snapshot(engine, job_id)
    assert (after_cancel["job"]["job_status"], after_cancel["job"]["status_reason"]) == (
        "cancelled", "operator_cancel")
    assert [(a["attempt_outcome"], a["ended_by"]) for a in after_cancel["attempts"]] == [
        ("lost", "operator")]

    writes: dict[str, Callable[[], Any]] = {
        "heartbeat": claim.heartbeat,
        "report_progress": claim.report_progress,
        "finish_step": lambda: claim.finish_step(0),
        "start_step": lambda: claim.start_step(1),
        "stage_artifact": lambda: claim.stage_artifact("out.txt"),
        "fail": lambda: claim.fail("Boom", retryable=True),
        "release": claim.release,
        "complete": claim.complete,
    }
    for name, write in writes.items():
        with pytest.raises(LeaseLost):
            write()
        assert snapshot(engine, job_id) == after_cancel, f"{name} wrote after the cancel"
    assert claim.lease_lost.is_set()
    assert actions_of(engine, job_id) == [
        ("cancel", "applied", None, "processing", "cancelled", generation, generation + 1)]
    # The reconciler has nothing left to do with it.
    assert reconcile(engine).decisions == ()


CLAIM_COLUMNS = ("lease_token", "lease_owner", "lease_expires_at", "worker_session_id")


def test_a_cancelled_job_ends_like_every_other_ended_job(
    client: JobClient, engine: Engine
) -> None:
    """Cancelled, completed, failed or terminalized by a pass: the job keeps no trace of the
    claim that held it (token, owner, lease, session), is finished, and its attempt ended."""
    session = client.store.register_session("host-a:1", "host-a", 1)
    ended: dict[str, int] = {}
    for how in ("complete", "fail", "terminalize", "cancel"):
        job_id = client.enqueue("report", steps=PLAN)
        claim = client.claim("host-a:1", lease_seconds=30 if how != "terminalize" else 0.2,
                             session_id=session)
        assert claim is not None
        assert claim.job_id == job_id
        claim.start_step(0)
        if how == "complete":
            claim.finish_step(0)
            claim.start_step(1)
            claim.finish_step(1)
            claim.start_step(2)
            claim.finish_step(2)
            claim.complete()
        elif how == "fail":
            claim.fail("Boom", retryable=False)
        elif how == "cancel":
            assert client.store.operator_action(job_id, "cancel") == (True, None)
        ended[how] = job_id
    # Out of attempts, the expired claim is terminalized (resume_exhausted), not resumed.
    wait_until_expired(engine, ended["terminalize"])
    with engine.begin() as conn:
        conn.execute(JOBS.update().where(JOBS.c.job_id == ended["terminalize"])
                     .values(attempt_count=JOBS.c.max_attempts))
    assert [(d.job_id, d.reason) for d in reconcile(engine).decisions] == [
        (ended["terminalize"], Reason.RESUME_EXHAUSTED)]

    for how, job_id in ended.items():
        row = snapshot(engine, job_id)
        job = row["job"]
        assert job["job_status"] in ("completed", "failed", "cancelled"), how
        assert {c: job[c] for c in CLAIM_COLUMNS} == dict.fromkeys(CLAIM_COLUMNS), how
        assert job["reconcile_parked"] is False, how
        assert job["finished_at"] is not None, how
        assert [a["ended_at"] is not None for a in row["attempts"]] == [True], how


def test_cancel_stops_a_running_worker_at_its_next_heartbeat_without_further_writes(
    client: JobClient, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Worker whose job is cancelled sees lease_lost at its next heartbeat (the first to
    reach the database after the cancel; none renews it after) and writes nothing."""
    job_id = client.enqueue("report", steps=PLAN)
    started = threading.Event()
    noticed: list[float] = []
    beats: list[tuple[float, str]] = []  # (when the heartbeat began, how it ended)
    renew = Claim.heartbeat

    def recorded(claim: Claim) -> None:
        began = time.monotonic()
        try:
            renew(claim)
        except LeaseLost:
            beats.append((began, "lost"))
            raise
        beats.append((began, "renewed"))

    monkeypatch.setattr(Claim, "heartbeat", recorded)

    def fetch(ctx: StepContext) -> None:
        started.set()
        if ctx.lease_lost.wait(DEADLINE_SECONDS):
            noticed.append(time.monotonic())

    def never(_ctx: StepContext) -> None:
        pytest.fail("a step ran after the cancel")

    worker = Worker(client, "cancelled-worker", lease_seconds=0.6, poll_interval_seconds=0.05)
    worker.register("report", {"fetch": fetch, "render": never, "publish": never})
    stats: list[WorkerStats] = []
    thread = threading.Thread(target=lambda: stats.append(worker.run(max_jobs=1)), daemon=True)
    thread.start()
    assert started.wait(DEADLINE_SECONDS)

    assert client.store.operator_action(job_id, "cancel") == (True, None)
    cancelled_at = time.monotonic()
    after_cancel = snapshot(engine, job_id)
    thread.join(DEADLINE_SECONDS)
    assert not thread.is_alive()
    assert noticed, "the handler never saw lease_lost"
    # The heartbeat that found the lease lost was the worker's last, and none began after
    # the cancel and renewed it: the loss was seen at the next heartbeat, however loaded.
    assert [how for _, how in beats].count("lost") == 1
    assert beats[-1][1] == "lost"
    assert not [began for began, how in beats if how == "renewed" and began > cancelled_at]
    assert noticed[0] >= beats[-1][0]
    assert stats[0].outcomes == {"lost": 1}
    assert snapshot(engine, job_id) == after_cancel
    assert after_cancel["job"]["job_status"] == "cancelled"


def test_cancel_racing_a_completion_has_exactly_one_winner(
    client: JobClient, engine: Engine
) -> None:
    """A cancel and a completion at the same instant: one applies, the other is refused."""
    outcomes = []
    for _ in range(30):
        job_id = client.enqueue("report", steps=PLAN)
        claim = claim_job(client, job_id)
        barrier = threading.Barrier(2)
        result: dict[str, Any] = {}

        def complete(claim: Claim = claim, barrier: threading.Barrier = barrier,
                     result: dict[str, Any] = result) -> None:
            barrier.wait(DEADLINE_SECONDS)
            try:
                claim.complete()
                result["completed"] = True
            except LeaseLost:
                result["completed"] = False

        racer = threading.Thread(target=complete, daemon=True)
        racer.start()
        barrier.wait(DEADLINE_SECONDS)
        applied, refusal = client.store.operator_action(job_id, "cancel")
        racer.join(DEADLINE_SECONDS)
        status = job_row(engine, job_id)["job_status"]
        if result["completed"]:
            assert (applied, refusal, status) == (False, "job_terminal", "completed")
        else:
            assert (applied, refusal, status) == (True, None, "cancelled")
        [(action, outcome, *_rest)] = actions_of(engine, job_id)
        assert (action, outcome) == ("cancel", "applied" if applied else "refused")
        outcomes.append(status)
    print(f"\ncancel vs complete: {outcomes.count('completed')} completed, "
          f"{outcomes.count('cancelled')} cancelled")


def test_operator_action_racing_a_heartbeat_is_applied_not_lost(
    client: JobClient, engine: Engine
) -> None:
    """Holding a job while its worker heartbeats applies the hold; never 'no such job'."""
    job_id = client.enqueue("report", steps=PLAN)
    claim = claim_job(client, job_id)
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            claim.heartbeat()

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        results = [client.store.operator_action(job_id, action)
                   for _ in range(40) for action in ("hold", "unhold")]
    finally:
        stop.set()
        beating.join(DEADLINE_SECONDS)
    assert set(results) == {(True, None)}, sorted(set(results), key=repr)
    assert len(actions_of(engine, job_id)) == 80


def test_unknown_job_is_refused_with_one_line(db_url: str, engine: Engine) -> None:
    """An action on a job id that does not exist exits non-zero with one line."""
    done = run_cli(db_url, "jobs", "cancel", "999", "--note", "gone")
    assert done.returncode == 5
    assert done.stderr.strip().splitlines() == ["reconciler: error: no job with id 999"]
