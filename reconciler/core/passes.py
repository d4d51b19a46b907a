"""One bounded reconciliation pass: compose the store and the decision table. No SQL here."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from reconciler import failpoints
from reconciler.core.decisions import Decision, Thresholds, decide
from reconciler.core.evidence import Evidence, EvidenceError, build_steps, parse_plan
from reconciler.core.ports import CandidateRow, Cursor, PlannedChange, RecordedDecision, Store
from reconciler.core.vocabulary import Disposition, PassOutcome, Reason

log = logging.getLogger("reconciler.pass")

LEADER_LEASE_NAME = "reconciler"


@dataclass(frozen=True, slots=True)
class PassConfig:
    """What one pass needs to know; built from Settings by the caller."""

    batch_size: int
    thresholds: Thresholds
    instance: str = field(default_factory=lambda: f"reconciler-{uuid.uuid4().hex[:12]}")
    leader_lease_seconds: float = 90.0
    session_timeout_seconds: float = 30.0
    use_leader_lease: bool = True
    release_leadership_after: bool = False


@dataclass(frozen=True, slots=True)
class PassReport:
    """The result of one pass: counts, every decision, and where the next pass resumes."""

    pass_id: int | None
    outcome: PassOutcome
    decisions: tuple[RecordedDecision, ...] = ()
    next_cursor: Cursor | None = None
    dry_run: bool = False

    def count(self, disposition: Disposition) -> int:
        """How many decisions of this disposition the pass made."""
        return sum(1 for d in self.decisions if d.disposition is disposition)


def evidence_from(row: CandidateRow) -> Evidence:
    """Turn raw candidate facts into evidence; EvidenceError when they contradict."""
    plan = parse_plan(row.plan_text)
    return Evidence(
        job_id=row.job_id, claim_generation=row.claim_generation,
        attempt_count=row.attempt_count, max_attempts=row.max_attempts,
        operator_hold=row.operator_hold, lease_live=row.lease_live,
        lease_expired_seconds=row.lease_expired_seconds,
        activity_age_seconds=row.activity_age_seconds,
        plan=plan, steps=build_steps(plan, row.step_rows), session_gone=row.session_gone,
    )


def plan_change(row: CandidateRow, thresholds: Thresholds) -> PlannedChange:
    """Decide one candidate; a job that cannot be evaluated becomes ``reconcile_error``."""
    try:
        evidence = evidence_from(row)
        return PlannedChange(decide(evidence, thresholds), row.claim_generation,
                             evidence.public_facts())
    except (EvidenceError, ValueError, TypeError) as exc:
        log.warning("event=reconcile_error job_id=%s error=%s", row.job_id, type(exc).__name__)
        return PlannedChange(
            Decision(row.job_id, Disposition.SKIP, Reason.RECONCILE_ERROR),
            row.claim_generation, {"error": type(exc).__name__},
        )


def explain_jobs(store: Store, job_ids: list[int], thresholds: Thresholds
                 ) -> list[PlannedChange]:
    """What the table decides for named processing jobs now; reads only, writes nothing.

    Unlike a pass it looks at jobs whatever their lease, so an operator can ask why a
    live job is left alone (``lease_live``) as well as what would happen to a stale one.
    """
    with store.pass_transaction(dry_run=True) as tx:
        return [plan_change(row, thresholds) for row in tx.evidence_for(job_ids)]


def run_pass(
    store: Store, config: PassConfig, *, dry_run: bool = False, after: Cursor | None = None
) -> PassReport:
    """Run one bounded pass: lead, select, decide, compare-and-swap, record; one transaction.

    The pass row, every decision and every change commit together, so a crash mid-pass
    leaves nothing half-applied and nothing applied without its record.
    """
    if dry_run:
        with store.pass_transaction(dry_run=True) as tx:
            rows = tx.candidates(config.batch_size, config.thresholds, after)
            planned = [plan_change(r, config.thresholds) for r in rows]
        previewed = tuple(
            RecordedDecision(p.decision.job_id, p.decision.disposition, p.decision.reason,
                             p.decision.resume_step_index, p.generation_before, None)
            for p in planned
        )
        return PassReport(None, PassOutcome.OK, previewed, dry_run=True)

    try:
        with store.pass_transaction(dry_run=False) as tx:
            if config.use_leader_lease and tx.take_leadership(
                LEADER_LEASE_NAME, config.instance, config.leader_lease_seconds
            ) is None:
                pass_id = tx.record_finished_pass(config.instance, PassOutcome.NOT_LEADER)
                return PassReport(pass_id, PassOutcome.NOT_LEADER)
            tx.expire_gone_sessions(config.session_timeout_seconds)
            rows = tx.candidates(config.batch_size, config.thresholds, after)
            if not rows:
                # Nothing stale: the pass row is the whole record, written in one statement.
                pass_id = tx.record_finished_pass(config.instance, PassOutcome.OK)
                return PassReport(pass_id, PassOutcome.OK)
            pass_id = tx.start_pass_record(config.instance)
            planned = [plan_change(r, config.thresholds) for r in rows]
            failpoints.hit("between_decide_and_apply")
            recorded = tx.apply(pass_id, planned, config.thresholds)
    finally:
        if config.use_leader_lease and config.release_leadership_after:
            store.release_leadership(LEADER_LEASE_NAME, config.instance)
    return PassReport(pass_id, PassOutcome.OK, tuple(recorded), next_cursor(rows, config))


def next_cursor(rows: list[CandidateRow], config: PassConfig) -> Cursor | None:
    """Where the expired-lease scan continues: only after a full page of expired leases.

    Wedged candidates (live leases) fill a batch only when that scan came up short, and
    their lease times lie in the future, so they never position the cursor.
    """
    expired = [Cursor(r.lease_expires_at, r.job_id)
               for r in rows if not r.lease_live and r.lease_expires_at is not None]
    return expired[-1] if len(expired) >= config.batch_size else None
