"""The reconciliation pass end to end, on SQLite and PostgreSQL.

Situations are made with the real worker client: a worker claims with a short lease,
records its steps, then simply stops (it "dies"); the lease runs out on the database's
clock. Direct SQL is used only for states the public API cannot produce: a corrupt step
plan, a step record outside the plan, and an operator hold while the store lacks the hold
command.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from models import (
    JobAttempt,
    JobRun,
    ReconcilerLease,
    ReconciliationDecision,
    ReconciliationPass,
    StepRun,
)
from reconciler.core.decisions import Thresholds
from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.passes import (
    PassConfig,
    PassReport,
    apply_and_record,
    plan_change,
    run_pass,
)
from reconciler.core.policy import PARKING_REASONS
from reconciler.core.ports import PlannedChange, RecordedDecision
from reconciler.core.vocabulary import Disposition, PassOutcome, Reason
from reconciler.sidecar.service import LEADER_LEASE_NAME
from reconciler.storage.clock import db_now, now_plus, seconds_since
from reconciler.storage.engines import is_postgresql, read_only
from reconciler.storage.native_kinds import kinded_native
from reconciler.storage.sql_store import SqlStore
from reconciler.worker import Claim, JobClient, LeaseLost, Step

jobs = cast(sa.Table, JobRun.__table__)
steps = cast(sa.Table, StepRun.__table__)
attempts = cast(sa.Table, JobAttempt.__table__)
passes = cast(sa.Table, ReconciliationPass.__table__)
decisions = cast(sa.Table, ReconciliationDecision.__table__)
leases = cast(sa.Table, ReconcilerLease.__table__)

WORKER = "host-private-7.internal:31337"
PAYLOAD = {"customer_email": "alice@example.invalid", "card_number": "4111-1111-SECRET"}
PAYLOAD_SECRETS = ("alice@example.invalid", "4111-1111-SECRET")
INSTANCE = "reconciler-under-test"
SHORT_LEASE = 0.3
SAFE_EVIDENCE_KEYS = frozenset({
    "attempts_used", "max_attempts", "operator_hold", "lease_live", "session_gone",
    "lease_expired_seconds", "activity_age_seconds", "plan_readable", "plan_length",
    "step_states", "effect_kinds", "first_unfinished_step", "lost_attempts_in_a_row",
    "completion_recoverable",
})
# An evidence error: its type, a code, and where (a step, a column), never a stored value.
ERROR_EVIDENCE_KEYS = frozenset({"error", "error_code", "step", "plan_length", "column"})

PURE = Step("render", "pure")
IDEMPOTENT = Step("fetch", "idempotent")
EFFECTFUL = Step("publish", "effectful")


# -- configuration ------------------------------------------------------------------------


def config(
    batch_size: int = 50, *, stale: float = 0.0, wedged: float = 60.0, **options: Any
) -> PassConfig:
    """A pass config with a fixed instance name, so the audit says which pass was ours."""
    options.setdefault("instance", INSTANCE)
    return PassConfig(
        batch_size=batch_size,
        thresholds=Thresholds(stale_after_seconds=stale, wedged_after_seconds=wedged),
        **options,
    )


# -- reading the database -----------------------------------------------------------------


def raw(table: sa.Table) -> list[sa.ColumnElement[Any]]:
    """Every column of a table, JSON columns as their stored text (a corrupt plan stays text)."""
    return [
        sa.cast(c, sa.Text).label(c.name) if isinstance(c.type, sa.JSON) else c
        for c in table.columns
    ]


def fetch(engine: Engine, query: sa.Select[Any]) -> list[dict[str, Any]]:
    """Rows of a read-only query as dicts (a deferred BEGIN on SQLite: takes no write lock)."""
    with engine.connect() as conn:
        return [dict(r._mapping) for r in read_only(conn).execute(query)]


def scalar(engine: Engine, query: sa.Select[Any]) -> Any:
    """The single value of a read-only query."""
    with engine.connect() as conn:
        return read_only(conn).execute(query).scalar_one()


def job(engine: Engine, job_id: int) -> dict[str, Any]:
    """The job_runs row of one job."""
    (row,) = fetch(engine, sa.select(*raw(jobs)).where(jobs.c.job_id == job_id))
    return row


def attempt(engine: Engine, job_id: int, generation: int) -> dict[str, Any]:
    """The job_attempts row of one claim."""
    (row,) = fetch(engine, sa.select(attempts).where(
        attempts.c.job_id == job_id, attempts.c.claim_generation == generation))
    return row


def decisions_for(engine: Engine, job_id: int) -> list[dict[str, Any]]:
    """Every stored decision about one job, with its evidence as the stored JSON text."""
    return fetch(engine, sa.select(
        decisions, sa.cast(decisions.c.decision_evidence, sa.Text).label("evidence_text"),
    ).where(decisions.c.job_id == job_id).order_by(decisions.c.decision_id))


def decisions_in(engine: Engine, pass_id: int) -> list[dict[str, Any]]:
    """Every stored decision of one pass."""
    return fetch(engine, sa.select(decisions).where(decisions.c.pass_id == pass_id)
                 .order_by(decisions.c.decision_id))


def pass_row(engine: Engine, pass_id: int | None) -> dict[str, Any]:
    """The reconciliation_passes row of one pass."""
    assert pass_id is not None
    (row,) = fetch(engine, sa.select(passes).where(passes.c.pass_id == pass_id))
    return row


def count(engine: Engine, table: sa.Table) -> int:
    """Rows in a table."""
    return int(scalar(engine, sa.select(sa.func.count()).select_from(table)))


def snapshot(engine: Engine) -> dict[str, list[dict[str, Any]]]:
    """Every row of every table the pass could touch, in a stable order."""
    keys = {
        "job_runs": (jobs, jobs.c.job_id),
        "step_runs": (steps, steps.c.job_id, steps.c.step_index),
        "job_attempts": (attempts, attempts.c.job_id, attempts.c.claim_generation),
        "reconciliation_passes": (passes, passes.c.pass_id),
        "reconciliation_decisions": (decisions, decisions.c.decision_id),
        "reconciler_leases": (leases, leases.c.lease_name),
    }
    return {
        name: fetch(engine, sa.select(*raw(table)).order_by(*order))
        for name, (table, *order) in keys.items()
    }


def leader(engine: Engine) -> dict[str, Any]:
    """The leader lease row, with whether it has expired on the database's clock."""
    (row,) = fetch(engine, sa.select(
        leases, (leases.c.lease_expires_at <= db_now()).label("expired"),
    ).where(leases.c.lease_name == LEADER_LEASE_NAME))
    return row


# -- waiting on database state, never on fixed sleeps ---------------------------------------


def wait_until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def wait_expired(engine: Engine, *job_ids: int) -> None:
    """Wait until every job's lease has expired by the database's clock."""
    query = sa.select(sa.func.count()).select_from(jobs).where(
        jobs.c.job_id.in_(job_ids), jobs.c.lease_expires_at <= db_now())
    wait_until(lambda: scalar(engine, query) == len(job_ids), f"leases of {job_ids} to expire")


def lease_is_live(engine: Engine, job_id: int) -> bool:
    """Whether the job's lease is still live by the database's clock."""
    return bool(scalar(engine, sa.select(jobs.c.lease_expires_at > db_now())
                       .where(jobs.c.job_id == job_id)))


def wait_idle(engine: Engine, job_id: int, seconds: float) -> None:
    """Wait until the job has had no activity for ``seconds`` by the database's clock."""
    query = sa.select(seconds_since(jobs.c.last_activity_at)).where(jobs.c.job_id == job_id)
    wait_until(lambda: float(scalar(engine, query)) >= seconds,
               f"job {job_id} to be idle for {seconds}s")


# -- making situations with the worker client -----------------------------------------------


@dataclass(frozen=True)
class Crashed:
    """A job whose worker claimed it, did some work and then stopped writing."""

    job_id: int
    generation: int
    lease_token: str
    claim: Claim


def crash(
    client: JobClient,
    engine: Engine,
    plan: Sequence[Step],
    work: Callable[[Claim], None] = lambda _claim: None,
    *,
    max_attempts: int = 3,
    lease_seconds: float = SHORT_LEASE,
    wait: bool = True,
    kind: str = "report",
) -> Crashed:
    """Enqueue, claim with a short lease, do ``work``, then die; wait until the lease expires."""
    job_id = client.enqueue(kind, steps=plan, max_attempts=max_attempts, payload=PAYLOAD)
    claim = client.claim(worker=WORKER, lease_seconds=lease_seconds, kinds=[kind])
    assert claim is not None
    assert claim.job_id == job_id
    work(claim)
    token = job(engine, job_id)["lease_token"]
    assert token
    if wait:
        wait_expired(engine, job_id)
    return Crashed(job_id, claim.generation, token, claim)


def finish(*indexes: int) -> Callable[[Claim], None]:
    """Work that starts and finishes the given steps."""
    def work(claim: Claim) -> None:
        for i in indexes:
            claim.start_step(i)
            claim.finish_step(i)
    return work


def mid_effect(claim: Claim) -> None:
    """Work that finishes step 0, starts step 1 and dies inside it."""
    finish(0)(claim)
    claim.start_step(1)


def gated(claim: Claim) -> None:
    """Work that finishes step 0, then step 1 waits on an external gate."""
    finish(0)(claim)
    claim.start_step(1)
    claim.wait_step(1)


def failed_retryably(claim: Claim) -> None:
    """Work whose step 0 fails with a retryable error, then the worker dies."""
    claim.start_step(0)
    claim.fail_step(0, "upstream_timeout", retryable=True)


class Heartbeat:
    """A worker's heartbeat thread; with ``progress`` it also reports that the handler moves."""

    def __init__(self, claim: Claim, *, progress: bool = False, interval: float = 0.05) -> None:
        self.claim = claim
        self.progress = progress
        self.interval = interval
        self.stopping = threading.Event()
        self.lost = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.claim.heartbeat()
                if self.progress:
                    self.claim.report_progress()
            except LeaseLost:
                self.lost.set()
                return
            except BaseException as exc:  # surfaced by the test, not swallowed
                self.errors.append(exc)
                return
            self.stopping.wait(self.interval)


@contextmanager
def beating(claim: Claim, *, progress: bool = False) -> Iterator[Heartbeat]:
    """Run a heartbeat thread for the block; fail the test on any unexpected error in it."""
    beat = Heartbeat(claim, progress=progress)
    beat.thread.start()
    try:
        yield beat
    finally:
        beat.stopping.set()
        beat.thread.join(timeout=10)
    assert not beat.errors, beat.errors


def set_operator_hold(store: SqlStore, engine: Engine, job_id: int) -> None:
    """Hold the job with the operator command where the store has it, else by direct SQL."""
    hold = getattr(store, "operator_action", None)
    if hold is not None:
        assert hold(job_id, "hold") == (True, None)
        return
    with engine.begin() as conn:
        conn.execute(jobs.update().where(jobs.c.job_id == job_id).values(operator_hold=True))


def corrupt_plan(engine: Engine, job_id: int, raw: str | None) -> None:
    """Direct SQL: store a step plan the public API would refuse (raw text, or SQL NULL)."""
    with engine.begin() as conn:
        if raw is None:
            conn.execute(jobs.update().where(jobs.c.job_id == job_id).values(step_plan=sa.null()))
            return
        # PostgreSQL's json column only accepts valid JSON; SQLite stores any text.
        value = "CAST(:plan AS json)" if is_postgresql(conn) else ":plan"
        conn.execute(sa.text(f"UPDATE job_runs SET step_plan = {value} WHERE job_id = :job"),
                     {"plan": raw, "job": job_id})


# -- assertions shared by the reason tests --------------------------------------------------


def assert_private(stored: dict[str, Any], crashed: Crashed) -> None:
    """The stored evidence holds only privacy-safe keys and no identity, token or payload."""
    text = stored["evidence_text"]
    evidence = json.loads(text)
    assert isinstance(evidence, dict)
    assert set(evidence) <= SAFE_EVIDENCE_KEYS or (
        "error" in evidence and set(evidence) <= ERROR_EVIDENCE_KEYS)
    for secret in (WORKER, "host-private-7", crashed.lease_token, *PAYLOAD_SECRETS):
        assert secret not in text
    for key in PAYLOAD:
        assert key not in text


def only_decision(engine: Engine, report: PassReport, crashed: Crashed) -> dict[str, Any]:
    """The one decision stored about the job, which belongs to this pass and its report."""
    (stored,) = decisions_for(engine, crashed.job_id)
    assert stored["pass_id"] == report.pass_id
    mine = [d for d in report.decisions if d.job_id == crashed.job_id]
    assert mine == [RecordedDecision(
        crashed.job_id, Disposition(stored["disposition"]), Reason(stored["decision_reason"]),
        stored["resume_step_index"], stored["generation_before"], stored["generation_after"],
    )]
    assert_private(stored, crashed)
    return stored


def assert_resumed(
    engine: Engine, report: PassReport, crashed: Crashed, reason: Reason, step: int
) -> dict[str, Any]:
    """Resumed: queued at ``step``, lease cleared, generation +1, attempt lost, decision kept."""
    row = job(engine, crashed.job_id)
    assert row["job_status"] == "queued"
    assert row["status_reason"] == reason.value
    assert row["resume_step_index"] == step
    assert row["claim_generation"] == crashed.generation + 1
    assert (row["lease_token"], row["lease_owner"], row["lease_expires_at"]) == (None,) * 3
    assert row["finished_at"] is None
    ended = attempt(engine, crashed.job_id, crashed.generation)
    assert (ended["ended_by"], ended["attempt_outcome"]) == ("reconciler", "lost")
    assert ended["ended_at"] is not None
    stored = only_decision(engine, report, crashed)
    assert (stored["disposition"], stored["decision_reason"]) == ("resume", reason.value)
    assert stored["generation_before"] == crashed.generation
    assert stored["generation_after"] == crashed.generation + 1
    assert stored["resume_step_index"] == step
    return stored


def assert_terminalized(
    engine: Engine, report: PassReport, crashed: Crashed, reason: Reason,
    *, outcome: str = "lost", status: str = "failed",
) -> dict[str, Any]:
    """Terminalized: failed (or completed, for a recovered completion) with the reason,
    generation +1, attempt ended, decision kept."""
    row = job(engine, crashed.job_id)
    assert row["job_status"] == status
    assert row["status_reason"] == reason.value
    assert row["claim_generation"] == crashed.generation + 1
    assert (row["lease_token"], row["lease_owner"], row["lease_expires_at"]) == (None,) * 3
    assert row["finished_at"] is not None
    ended = attempt(engine, crashed.job_id, crashed.generation)
    assert (ended["ended_by"], ended["attempt_outcome"]) == ("reconciler", outcome)
    assert ended["ended_at"] is not None
    stored = only_decision(engine, report, crashed)
    assert (stored["disposition"], stored["decision_reason"]) == ("terminalize", reason.value)
    assert stored["generation_before"] == crashed.generation
    assert stored["generation_after"] == crashed.generation + 1
    assert stored["resume_step_index"] is None
    return stored


def assert_skipped(
    engine: Engine, report: PassReport, crashed: Crashed, reason: Reason,
    before: dict[str, Any],
) -> dict[str, Any]:
    """Skipped: the job row is as before (parked, if its skip lasts until someone acts),
    its attempt still open, the decision kept."""
    after = job(engine, crashed.job_id)
    assert after.pop("reconcile_parked") is (reason in PARKING_REASONS)
    assert after == {k: v for k, v in before.items() if k != "reconcile_parked"}
    assert before["job_status"] == "processing"
    assert before["claim_generation"] == crashed.generation
    still_open = attempt(engine, crashed.job_id, crashed.generation)
    assert (still_open["ended_at"], still_open["ended_by"]) == (None, None)
    stored = only_decision(engine, report, crashed)
    assert (stored["disposition"], stored["decision_reason"]) == ("skip", reason.value)
    assert stored["generation_before"] == crashed.generation
    assert stored["generation_after"] is None
    assert stored["resume_step_index"] is None
    return stored


def assert_counts_match(engine: Engine, report: PassReport) -> dict[str, Any]:
    """The pass row is finished, ok, and its counts equal the decisions stored for it."""
    row = pass_row(engine, report.pass_id)
    stored = decisions_in(engine, cast(int, report.pass_id))
    assert row["pass_outcome"] == PassOutcome.OK.value
    assert row["finished_at"] is not None
    assert row["reconciler_instance"] == INSTANCE
    assert row["candidates_seen"] == len(stored) == len(report.decisions)
    for disposition, column in (("resume", "resumed_count"),
                                ("terminalize", "terminalized_count"),
                                ("skip", "skipped_count")):
        assert row[column] == sum(1 for d in stored if d["disposition"] == disposition)
        assert row[column] == report.count(Disposition(disposition))
    return row


# -- one test per reason code ---------------------------------------------------------------


def test_operator_hold_is_skipped_and_left_untouched(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """An expired job held by an operator is recorded as skip operator_hold and not changed."""
    crashed = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0))
    set_operator_hold(store, engine, crashed.job_id)
    before = job(engine, crashed.job_id)

    report = run_pass(store, config())

    stored = assert_skipped(engine, report, crashed, Reason.OPERATOR_HOLD, before)
    assert json.loads(stored["evidence_text"])["operator_hold"] is True
    assert_counts_match(engine, report)


LIVE_LEASE = 30.0
WEDGED_AFTER = 2.0


def test_wedged_worker_is_failed_not_requeued_while_an_active_one_is_left_alone(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """A live lease beating on without activity ends failed worker_wedged, attempt abandoned."""
    # Leases far longer than any pause a loaded machine gives the heartbeat threads, and a
    # wedged threshold longer than the active worker's progress could be starved: only
    # the wedged worker's silence decides.
    wedged = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0),
                   lease_seconds=LIVE_LEASE, wait=False)
    active = crash(client, engine, [IDEMPOTENT], lease_seconds=LIVE_LEASE, wait=False)
    with beating(wedged.claim) as hung, beating(active.claim, progress=True) as moving:
        wedged.claim.start_step(1)  # the handler enters its effectful step and hangs there
        wait_idle(engine, wedged.job_id, WEDGED_AFTER + 0.1)
        assert lease_is_live(engine, wedged.job_id)
        before_active = job(engine, active.job_id)["claim_generation"]

        # A pass skips a row another transaction holds (SKIP LOCKED): a beat of the
        # wedged worker writing its lease at that instant (three statements on MySQL)
        # leaves it to the next pass, as the sidecar's next tick would.
        reports = []

        def decided() -> bool:
            reports.append(run_pass(store, config(stale=0.0, wedged=WEDGED_AFTER)))
            return bool(reports[-1].decisions)

        wait_until(decided, "a pass to decide the wedged job", timeout=30.0)
        report = reports[-1]

        # The next beat after the decision is refused; on a busy machine it may come late.
        # A beat that failed otherwise ends the wait at once and is named, as is what the
        # pass decided.
        decided = [(d.job_id, d.disposition.value, d.reason.value) for d in report.decisions]
        wait_until(lambda: hung.lost.is_set() or bool(hung.errors),
                   f"the wedged worker's heartbeat to be refused (the pass decided "
                   f"{decided})", timeout=30.0)
        assert not hung.errors, hung.errors
        assert not moving.lost.is_set()
    stored = assert_terminalized(engine, report, wedged, Reason.WORKER_WEDGED,
                                 outcome="abandoned")
    evidence = json.loads(stored["evidence_text"])
    assert evidence["lease_live"] is True
    assert evidence["activity_age_seconds"] >= WEDGED_AFTER
    row = job(engine, wedged.job_id)
    assert row["attempt_count"] == 1 < row["max_attempts"]  # budget left, still not requeued
    assert [d.job_id for d in report.decisions] == [wedged.job_id]
    assert decisions_for(engine, active.job_id) == []
    assert job(engine, active.job_id)["job_status"] == "processing"
    assert job(engine, active.job_id)["claim_generation"] == before_active
    with pytest.raises(LeaseLost):
        wedged.claim.complete()
    assert job(engine, wedged.job_id)["job_status"] == "failed"
    assert client.claim(worker="another", lease_seconds=5, kinds=["report"]) is None
    assert_counts_match(engine, report)


def test_expired_lease_with_recent_activity_is_skipped_until_stale(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """An expired lease with activity younger than stale_after_seconds is skip recent_activity."""
    crashed = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0))
    before = job(engine, crashed.job_id)

    report = run_pass(store, config(stale=30.0, wedged=60.0))

    stored = assert_skipped(engine, report, crashed, Reason.RECENT_ACTIVITY, before)
    evidence = json.loads(stored["evidence_text"])
    assert evidence["lease_live"] is False
    assert 0 <= evidence["activity_age_seconds"] < 30
    assert_counts_match(engine, report)

    stale = run_pass(store, config(stale=0.0, wedged=60.0))  # the same job, judged stale
    assert [(d.job_id, d.reason) for d in stale.decisions] == [
        (crashed.job_id, Reason.RESUMED_FROM_UNSTARTED_STEP)]
    assert job(engine, crashed.job_id)["job_status"] == "queued"


def test_unreadable_step_plans_are_terminalized_unresumable(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """A missing, non-list, unknown-effect or non-JSON plan ends failed unresumable_plan."""
    corruptions: list[str | None] = [
        None, '{"steps": "not a list"}', '[{"step_name": "x", "effect_kind": "nuclear"}]', "[]",
    ]
    if engine.dialect.name == "sqlite":  # PostgreSQL's and MySQL's JSON refuse non-JSON
        corruptions.append("this is {not json")
    crashed = []
    for raw in corruptions:
        one = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0), wait=False)
        corrupt_plan(engine, one.job_id, raw)
        crashed.append(one)
    wait_expired(engine, *(c.job_id for c in crashed))

    report = run_pass(store, config())

    for one in crashed:
        stored = assert_terminalized(engine, report, one, Reason.UNRESUMABLE_PLAN)
        evidence = json.loads(stored["evidence_text"])
        assert evidence["plan_readable"] is False
        assert evidence["step_states"] is None
    row = assert_counts_match(engine, report)
    assert row["terminalized_count"] == len(corruptions)


def test_step_waiting_on_a_gate_is_skipped(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """An expired job whose first unfinished step waits on a gate is skip waiting_on_gate."""
    crashed = crash(client, engine, [IDEMPOTENT, EFFECTFUL], gated)
    before = job(engine, crashed.job_id)

    report = run_pass(store, config())

    stored = assert_skipped(engine, report, crashed, Reason.WAITING_ON_GATE, before)
    assert json.loads(stored["evidence_text"])["step_states"] == ["succeeded", "waiting"]
    assert_counts_match(engine, report)


def test_all_steps_done_without_completion_is_finished_completed(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """Every step succeeded and its artifacts are staged, but the worker died before
    complete(): the pass records the completion (completion_recovered), publishing the
    staged artifacts of that generation, and the attempt ends completed."""
    def staged_and_done(claim: Claim) -> None:
        claim.stage_artifact("report.pdf")
        finish(0, 1)(claim)

    crashed = crash(client, engine, [PURE, EFFECTFUL], staged_and_done)

    report = run_pass(store, config())

    stored = assert_terminalized(engine, report, crashed, Reason.COMPLETION_RECOVERED,
                                 outcome="completed", status="completed")
    evidence = json.loads(stored["evidence_text"])
    assert evidence["step_states"] == ["succeeded", "succeeded"]
    assert evidence["first_unfinished_step"] is None
    assert evidence["completion_recoverable"] is True
    assert store.artifacts_of(crashed.job_id) == [
        (crashed.generation, "report.pdf", "published")]
    assert_counts_match(engine, report)


def test_permanent_step_failure_then_death_is_terminalized(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """A step failed with retryable=False, then the worker died: step_failed."""
    def work(claim: Claim) -> None:
        claim.start_step(0)
        claim.fail_step(0, "card_declined", retryable=False)

    crashed = crash(client, engine, [EFFECTFUL, PURE], work)

    report = run_pass(store, config())

    stored = assert_terminalized(engine, report, crashed, Reason.STEP_FAILED)
    assert json.loads(stored["evidence_text"])["step_states"] == ["failed", "not_started"]
    assert_counts_match(engine, report)


def test_death_inside_an_effectful_step_is_terminalized(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """The worker died after starting an effectful step: worker_died_mid_step, never resumed."""
    crashed = crash(client, engine, [IDEMPOTENT, EFFECTFUL], mid_effect)

    report = run_pass(store, config())

    stored = assert_terminalized(engine, report, crashed, Reason.WORKER_DIED_MID_STEP)
    evidence = json.loads(stored["evidence_text"])
    assert evidence["step_states"] == ["succeeded", "started"]
    assert evidence["effect_kinds"] == ["idempotent", "effectful"]
    assert_counts_match(engine, report)


def test_spent_attempt_budget_is_terminalized(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """A resumable job whose only attempt is used (max_attempts=1) ends resume_exhausted."""
    crashed = crash(client, engine, [PURE, EFFECTFUL], finish(0), max_attempts=1)

    report = run_pass(store, config())

    stored = assert_terminalized(engine, report, crashed, Reason.RESUME_EXHAUSTED)
    evidence = json.loads(stored["evidence_text"])
    assert (evidence["attempts_used"], evidence["max_attempts"]) == (1, 1)
    assert job(engine, crashed.job_id)["attempt_count"] == 1
    assert_counts_match(engine, report)


def test_interrupted_idempotent_step_is_resumed_at_that_step(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """Death inside an idempotent step resumes the job at that step (resumed_idempotent_step)."""
    crashed = crash(client, engine, [PURE, IDEMPOTENT, EFFECTFUL], mid_effect)

    report = run_pass(store, config())

    stored = assert_resumed(engine, report, crashed, Reason.RESUMED_IDEMPOTENT_STEP, 1)
    assert json.loads(stored["evidence_text"])["step_states"] == [
        "succeeded", "started", "not_started"]
    assert job(engine, crashed.job_id)["attempt_count"] == 1  # the next claim consumes one
    assert_counts_match(engine, report)
    again = client.claim(worker="host-b", lease_seconds=5)
    assert again is not None
    assert (again.job_id, again.next_step_index) == (crashed.job_id, 1)
    assert (again.generation, again.attempt) == (crashed.generation + 2, 2)


def test_death_between_steps_is_resumed_at_the_unstarted_step(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """Step 0 finished and step 1 never started: resume at 1 (resumed_from_unstarted_step)."""
    crashed = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0))

    report = run_pass(store, config())

    stored = assert_resumed(engine, report, crashed, Reason.RESUMED_FROM_UNSTARTED_STEP, 1)
    evidence = json.loads(stored["evidence_text"])
    assert evidence["step_states"] == ["succeeded", "not_started"]
    assert evidence["first_unfinished_step"] == 1
    assert_counts_match(engine, report)
    again = client.claim(worker="host-b", lease_seconds=5)
    assert again is not None
    assert (again.job_id, again.next_step_index) == (crashed.job_id, 1)


def test_unreadable_step_record_is_reconcile_error_and_the_batch_goes_on(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """A step record outside the plan is recorded reconcile_error; the other jobs are decided."""
    broken = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0), wait=False)
    with engine.begin() as conn:
        conn.execute(steps.insert().values(
            job_id=broken.job_id, step_index=7, step_name="ghost", effect_kind="pure",
            step_state="succeeded", claim_generation=broken.generation,
            started_at=datetime.now(UTC),
        ))
    resumable = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0), wait=False)
    doomed = crash(client, engine, [IDEMPOTENT, EFFECTFUL], mid_effect, wait=False)
    wait_expired(engine, broken.job_id, resumable.job_id, doomed.job_id)
    before = job(engine, broken.job_id)

    report = run_pass(store, config())

    stored = assert_skipped(engine, report, broken, Reason.RECONCILE_ERROR, before)
    # Which fact, privacy-safe: a code and the step, never the stored value or a message.
    assert json.loads(stored["evidence_text"]) == {
        "error": "EvidenceError", "error_code": "step_outside_plan", "step": 7,
        "plan_length": 2}
    assert_resumed(engine, report, resumable, Reason.RESUMED_FROM_UNSTARTED_STEP, 1)
    assert_terminalized(engine, report, doomed, Reason.WORKER_DIED_MID_STEP)
    row = assert_counts_match(engine, report)
    assert (row["candidates_seen"], row["resumed_count"], row["terminalized_count"],
            row["skipped_count"]) == (3, 1, 1, 1)


# -- fence_lost: the compare-and-swap repeats the evidence ----------------------------------


def decide_now(store: SqlStore, thresholds: Thresholds) -> list[PlannedChange]:
    """Load the candidates and decide them in one transaction, as a pass would."""
    with store.pass_transaction(dry_run=False) as tx:
        rows = tx.jobs.candidates(50, thresholds, None)
        return [plan_change(r, thresholds) for r in rows]


def apply_late(store: SqlStore, planned: list[PlannedChange]
               ) -> tuple[int, list[RecordedDecision]]:
    """Apply planned changes in a fresh pass transaction with its own pass row."""
    with store.pass_transaction(dry_run=False) as tx:
        return apply_and_record(tx, INSTANCE, planned)


def assert_fence_lost(
    engine: Engine, crashed: Crashed, pass_id: int, recorded: list[RecordedDecision],
    before: dict[str, list[dict[str, Any]]],
) -> None:
    """The late apply changed no job or attempt and recorded exactly one skip fence_lost."""
    assert recorded == [RecordedDecision(
        crashed.job_id, Disposition.SKIP, Reason.FENCE_LOST, None, crashed.generation, None)]
    after = snapshot(engine)
    for table in ("job_runs", "step_runs", "job_attempts"):
        assert after[table] == before[table], table
    (stored,) = decisions_in(engine, pass_id)
    assert (stored["job_id"], stored["disposition"], stored["decision_reason"]) == (
        str(crashed.job_id), "skip", "fence_lost")
    assert (stored["generation_before"], stored["generation_after"],
            stored["resume_step_index"]) == (crashed.generation, None, None)
    row = pass_row(engine, pass_id)
    assert (row["candidates_seen"], row["resumed_count"], row["terminalized_count"],
            row["skipped_count"], row["pass_outcome"]) == (1, 0, 0, 1, "ok")
    assert row["finished_at"] is not None


def test_heartbeat_after_the_decision_makes_the_resume_lose_its_fence(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """A heartbeat between decide and apply (same generation) turns the resume into fence_lost."""
    thresholds = Thresholds(stale_after_seconds=0.0, wedged_after_seconds=60.0)
    crashed = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0), lease_seconds=0.5)
    planned = decide_now(store, thresholds)
    assert [(p.decision.job_id, p.decision.reason) for p in planned] == [
        (crashed.job_id, Reason.RESUMED_FROM_UNSTARTED_STEP)]

    # The worker was only slow: its heartbeat makes the lease live again, for long enough
    # that the late apply cannot see it expired a second time on a loaded machine.
    store.heartbeat(crashed.job_id, crashed.claim._token, 30.0)
    before = snapshot(engine)
    assert before["job_runs"][0]["claim_generation"] == crashed.generation
    pass_id, recorded = apply_late(store, planned)

    assert_fence_lost(engine, crashed, pass_id, recorded, before)
    assert job(engine, crashed.job_id)["job_status"] == "processing"


def test_reclaim_after_the_decision_makes_the_resume_lose_its_fence(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """A reclaim between decide and apply bumps the generation: the stale apply is fence_lost."""
    thresholds = Thresholds(stale_after_seconds=0.0, wedged_after_seconds=60.0)
    crashed = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0))
    planned = decide_now(store, thresholds)
    assert [p.generation_before for p in planned] == [crashed.generation]

    # Another replica resumes the job and another worker claims it, then dies as well, so
    # only the generation (not the lease's expiry) tells the stale plan apart.
    other = run_pass(store, config())
    assert [d.reason for d in other.decisions] == [Reason.RESUMED_FROM_UNSTARTED_STEP]
    second = client.claim(worker="host-b", lease_seconds=SHORT_LEASE)
    assert second is not None
    assert second.generation == crashed.generation + 2
    wait_expired(engine, crashed.job_id)
    before = snapshot(engine)
    pass_id, recorded = apply_late(store, planned)

    assert_fence_lost(engine, crashed, pass_id, recorded, before)
    row = job(engine, crashed.job_id)
    assert (row["job_status"], row["claim_generation"]) == ("processing", second.generation)
    assert attempt(engine, crashed.job_id, second.generation)["ended_at"] is None


def test_late_completion_after_the_decision_makes_the_terminalize_lose_its_fence(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """A worker that completes between decide and apply keeps its completion: fence_lost."""
    thresholds = Thresholds(stale_after_seconds=0.0, wedged_after_seconds=60.0)
    crashed = crash(client, engine, [PURE, EFFECTFUL], finish(0, 1))
    planned = decide_now(store, thresholds)
    assert [p.decision.reason for p in planned] == [Reason.COMPLETION_RECOVERED]

    crashed.claim.complete()
    before = snapshot(engine)
    pass_id, recorded = apply_late(store, planned)

    assert_fence_lost(engine, crashed, pass_id, recorded, before)
    assert job(engine, crashed.job_id)["job_status"] == "completed"


def test_progress_after_a_wedged_decision_makes_it_lose_its_fence(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """Progress reported between a worker_wedged decision and its apply turns it into fence_lost."""
    # The apply must come within wedged_after_seconds of the progress, or the job is silent
    # long enough again and its fence holds: a minute (a loaded MariaDB outran 0.3 s and
    # 2 s), the job made silent for two by setting its last activity back.
    thresholds = Thresholds(stale_after_seconds=0.0, wedged_after_seconds=60.0)
    crashed = crash(client, engine, [IDEMPOTENT, EFFECTFUL], lease_seconds=300, wait=False)
    with engine.begin() as conn:
        conn.execute(jobs.update().where(jobs.c.job_id == crashed.job_id)
                     .values(last_activity_at=now_plus(-120)))
    planned = decide_now(store, thresholds)
    assert [p.decision.reason for p in planned] == [Reason.WORKER_WEDGED]

    crashed.claim.report_progress()  # the handler was slow, not hung
    before = snapshot(engine)
    pass_id, recorded = apply_late(store, planned)

    assert_fence_lost(engine, crashed, pass_id, recorded, before)
    crashed.claim.complete()


# -- the pass as a whole --------------------------------------------------------------------


def test_pass_row_counts_equal_its_decisions_and_a_second_pass_sees_nothing_new(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """A mixed batch is counted exactly on the pass row; the next pass is quiet (the gated
    job, recorded once, is parked out of the scans)."""
    resumed = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0), wait=False)
    retried = crash(client, engine, [IDEMPOTENT, EFFECTFUL], failed_retryably, wait=False)
    dead = crash(client, engine, [IDEMPOTENT, EFFECTFUL], mid_effect, wait=False)
    waiting = crash(client, engine, [IDEMPOTENT, EFFECTFUL], gated, wait=False)
    wait_expired(engine, resumed.job_id, retried.job_id, dead.job_id, waiting.job_id)

    first = run_pass(store, config())

    row = assert_counts_match(engine, first)
    assert (row["candidates_seen"], row["resumed_count"], row["terminalized_count"],
            row["skipped_count"]) == (4, 2, 1, 1)
    assert row["started_at"] <= row["finished_at"]
    assert_resumed(engine, first, resumed, Reason.RESUMED_FROM_UNSTARTED_STEP, 1)
    # A step that failed retryably never applied anything: resume at it.
    assert_resumed(engine, first, retried, Reason.RESUMED_FROM_UNSTARTED_STEP, 0)
    assert_terminalized(engine, first, dead, Reason.WORKER_DIED_MID_STEP)
    assert first.next_cursor is None

    second = run_pass(store, config())

    assert second.decisions == ()
    again = pass_row(engine, second.pass_id)
    assert (again["candidates_seen"], again["skipped_count"]) == (0, 0)
    assert decisions_in(engine, second.pass_id) == []
    assert len(decisions_for(engine, waiting.job_id)) == 1
    assert len(decisions_for(engine, resumed.job_id)) == 1
    assert len(decisions_for(engine, dead.job_id)) == 1


def test_a_held_leader_lease_gates_no_pass_and_fences_holder_changes(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """While A holds the chores' lease, B still passes and decides; the lease's token
    grows only on handover, a renewal keeps it, and a lapsed lease can be taken."""
    assert store.try_lead(LEADER_LEASE_NAME, "replica-a", 30) == 1
    crashed = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0))

    report = run_pass(store, config(instance="replica-b"))
    assert report.outcome is PassOutcome.OK
    assert [d.job_id for d in report.decisions] == [crashed.job_id]
    assert pass_row(engine, report.pass_id)["reconciler_instance"] == "replica-b"

    first = leader(engine)
    assert store.try_lead(LEADER_LEASE_NAME, "replica-b", 30) is None
    assert store.try_lead(LEADER_LEASE_NAME, "replica-a", 30) == 1  # a renewal keeps it
    assert leader(engine)["lease_expires_at"] >= first["lease_expires_at"]

    store.release_leadership(LEADER_LEASE_NAME, "replica-b")  # not the holder: no effect
    assert not leader(engine)["expired"]
    store.release_leadership(LEADER_LEASE_NAME, "replica-a")
    assert leader(engine)["expired"]
    assert store.try_lead(LEADER_LEASE_NAME, "replica-b", 0.2) == 2
    assert store.try_lead(LEADER_LEASE_NAME, "replica-a", 30) is None
    wait_until(lambda: bool(leader(engine)["expired"]), "the leader lease to run out")
    assert store.try_lead(LEADER_LEASE_NAME, "replica-a", 30) == 3


def test_dry_run_decides_but_writes_nothing(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """A dry run reports every decision but leaves jobs, passes and decisions unchanged."""
    resumable = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0), wait=False)
    doomed = crash(client, engine, [IDEMPOTENT, EFFECTFUL], mid_effect, wait=False)
    held = crash(client, engine, [IDEMPOTENT, EFFECTFUL], wait=False)
    set_operator_hold(store, engine, held.job_id)
    wait_expired(engine, resumable.job_id, doomed.job_id, held.job_id)
    before = snapshot(engine)

    preview = run_pass(store, config(), dry_run=True)

    assert snapshot(engine) == before
    assert preview.dry_run is True
    assert preview.pass_id is None
    assert preview.outcome is PassOutcome.OK
    expected = {
        RecordedDecision(resumable.job_id, Disposition.RESUME,
                         Reason.RESUMED_FROM_UNSTARTED_STEP, 1, resumable.generation, None),
        RecordedDecision(doomed.job_id, Disposition.TERMINALIZE, Reason.WORKER_DIED_MID_STEP,
                         None, doomed.generation, None),
        RecordedDecision(held.job_id, Disposition.SKIP, Reason.OPERATOR_HOLD, None,
                         held.generation, None),
    }
    assert set(preview.decisions) == expected
    assert count(engine, passes) == count(engine, decisions) == 0

    real = run_pass(store, config())
    assert {(d.job_id, d.disposition, d.reason) for d in real.decisions} == {
        (d.job_id, d.disposition, d.reason) for d in expected}


@pytest.mark.parametrize("kinded", [False, True], ids=["plain", "kinds"])
def test_batch_is_bounded_and_paging_by_cursor_reaches_every_expired_job(
    client: JobClient, engine: Engine, store: SqlStore, kinded: bool
) -> None:
    """With 7 expired jobs and batch 3, each page has at most 3; the cursor reaches all of them
    (also through the scans a ``[kinds]`` table builds)."""
    expired = [crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0), wait=False)
               for _ in range(7)]
    alive = [crash(client, engine, [IDEMPOTENT], lease_seconds=30, wait=False)
             for _ in range(2)]
    wait_expired(engine, *(c.job_id for c in expired))
    # Activity younger than stale_after_seconds: every page skips, so nothing leaves the scan
    # and only the cursor can move the next pass on.
    paging = config(3, stale=30.0, wedged=60.0)
    if kinded:  # a table with its own wedged time: the kinded source's scans
        kinds = KindRules([KindRule("other.*", wedged_after_seconds=120.0)],
                          stale_after_seconds=30.0, wedged_after_seconds=60.0, max_attempts=3)
        store = SqlStore(engine, kinded_native(kinds))
        paging = replace(paging, kinds=kinds)

    pages: list[list[int]] = []
    cursor = None
    while True:
        report = run_pass(store, paging, after=cursor)
        assert_counts_match(engine, report)
        pages.append([d.job_id for d in report.decisions])
        assert {d.reason for d in report.decisions} <= {Reason.RECENT_ACTIVITY}
        cursor = report.next_cursor
        if cursor is None:
            break
        assert len(pages) < 5, "the cursor never ran out"

    assert pages == [[c.job_id for c in expired[i:i + 3]] for i in (0, 3, 6)]
    assert run_pass(store, paging).decisions[0].job_id == expired[0].job_id  # no cursor: start
    for live in alive:
        assert decisions_for(engine, live.job_id) == []


def test_one_pass_acts_on_at_most_batch_size_jobs(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """Of 7 expired resumable jobs a batch-3 pass resumes exactly the 3 oldest leases."""
    expired = [crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0), wait=False)
               for _ in range(7)]
    alive = crash(client, engine, [IDEMPOTENT], lease_seconds=30, wait=False)
    wait_expired(engine, *(c.job_id for c in expired))

    report = run_pass(store, config(3))

    assert [d.job_id for d in report.decisions] == [c.job_id for c in expired[:3]]
    assert report.count(Disposition.RESUME) == 3
    assert report.next_cursor is not None
    for c in expired[3:]:
        row = job(engine, c.job_id)
        assert (row["job_status"], row["claim_generation"]) == ("processing", c.generation)
    follow = run_pass(store, config(3), after=report.next_cursor)
    assert [d.job_id for d in follow.decisions] == [c.job_id for c in expired[3:6]]
    rest = run_pass(store, config(3), after=follow.next_cursor)
    assert [d.job_id for d in rest.decisions] == [expired[6].job_id]
    assert rest.next_cursor is None
    assert count(engine, decisions) == 7
    assert decisions_for(engine, alive.job_id) == []
    assert job(engine, alive.job_id)["job_status"] == "processing"


def test_cursor_after_a_batch_topped_up_by_a_wedged_job_still_reaches_expired_jobs(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """A batch filled by a wedged live lease must not hand out a cursor past later expiries."""
    first = [crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0), wait=False)
             for _ in range(2)]
    wedged = crash(client, engine, [IDEMPOTENT], lease_seconds=30, wait=False)
    wait_expired(engine, *(c.job_id for c in first))
    wait_idle(engine, wedged.job_id, 0.4)

    report = run_pass(store, config(3, wedged=0.3))

    assert [(d.job_id, d.reason) for d in report.decisions] == [
        (first[0].job_id, Reason.RESUMED_FROM_UNSTARTED_STEP),
        (first[1].job_id, Reason.RESUMED_FROM_UNSTARTED_STEP),
        (wedged.job_id, Reason.WORKER_WEDGED),
    ]
    later = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0), kind="export")
    unpaged = run_pass(store, config(3, wedged=0.3), dry_run=True)
    assert [d.job_id for d in unpaged.decisions] == [later.job_id]  # it is a candidate
    follow = run_pass(store, config(3, wedged=0.3), after=report.next_cursor)
    assert [d.job_id for d in follow.decisions] == [later.job_id]


def test_the_wedged_scan_pages_so_skipped_wedged_jobs_cannot_starve_the_rest(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """Three wedged live leases and batches of 2 in shadow mode (which changes nothing, so
    the first two stay wedged): the cursor carries the next pass on to the third."""
    wedged = [crash(client, engine, [IDEMPOTENT], lease_seconds=30, wait=False)
              for _ in range(3)]
    wait_idle(engine, wedged[-1].job_id, 0.4)
    paging = config(2, wedged=0.3, shadow=True)

    first = run_pass(store, paging)
    second = run_pass(store, paging, after=first.next_cursor)

    assert [(d.job_id, d.reason) for d in first.decisions] == [
        (w.job_id, Reason.WORKER_WEDGED) for w in wedged[:2]]
    assert [d.job_id for d in second.decisions] == [wedged[2].job_id]
    assert second.next_cursor is None
    assert [d.job_id for d in run_pass(store, paging).decisions] == [
        w.job_id for w in wedged[:2]]  # no cursor: the sweep starts over


def test_heartbeating_job_stays_out_of_every_pass(
    client: JobClient, engine: Engine, store: SqlStore
) -> None:
    """A job whose short lease is renewed before expiry is never a candidate of any pass."""
    dead = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0), wait=False)
    living = crash(client, engine, [IDEMPOTENT, EFFECTFUL], finish(0), lease_seconds=0.5,
                   wait=False)
    reports = []
    with beating(living.claim) as beat:
        wait_expired(engine, dead.job_id)
        deadline = time.monotonic() + 1.6  # more than three lease lengths
        while time.monotonic() < deadline:
            reports.append(run_pass(store, config()))
            time.sleep(0.1)
        assert not beat.lost.is_set()

    assert len(reports) >= 5
    assert [d.job_id for r in reports for d in r.decisions] == [dead.job_id]
    assert decisions_for(engine, living.job_id) == []
    row = job(engine, living.job_id)
    assert (row["job_status"], row["claim_generation"]) == ("processing", living.generation)
    living.claim.start_step(1)
    living.claim.finish_step(1)
    living.claim.complete()
    assert job(engine, living.job_id)["job_status"] == "completed"
