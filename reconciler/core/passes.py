"""One bounded reconciliation pass: compose the ports and the decision table. No SQL here.

The pass reads candidates from a job source, decides each with the pure table, applies
the non-skip decisions through the same source as compare-and-swaps, and records the
pass and every decision in the audit log, all in one unit of work.
"""

from __future__ import annotations

import gc
import logging
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from reconciler import failpoints
from reconciler.core.brake import BrakeLimits, apply_brake, brake, count_limit
from reconciler.core.conflicts import retried
from reconciler.core.decisions import Decision, Thresholds, decide
from reconciler.core.evidence import (
    Evidence,
    EvidenceError,
    build_steps,
    parse_plan,
    round_age,
)
from reconciler.core.kinds import KindRules
from reconciler.core.policy import PARKING_REASONS
from reconciler.core.ports import (
    Candidate,
    Cursor,
    JobKey,
    LivenessUnknown,
    PassStore,
    PassUnit,
    PlannedChange,
    RecordedDecision,
    StuckWork,
)
from reconciler.core.stuck import held_back
from reconciler.core.vocabulary import Disposition, PassOutcome, Reason

log = logging.getLogger("reconciler.pass")

@dataclass(frozen=True, slots=True)
class PassConfig:
    """What one pass needs to know; built from Settings by the caller."""

    batch_size: int
    thresholds: Thresholds
    """The defaults; a kind's own thresholds come from ``kinds`` where it is given."""
    instance: str = field(default_factory=lambda: f"reconciler-{uuid.uuid4().hex[:12]}")
    session_timeout_seconds: float = 30.0
    kinds: KindRules | None = None
    """Per-kind rules from the configuration's ``[kinds]`` tables."""
    shadow: bool = False
    """Decide and record every decision marked shadow; change no job."""
    brake: BrakeLimits | None = None
    """The mass-staleness brake's limits; None: no brake."""

    def thresholds_for(self, kind: str) -> Thresholds:
        """The thresholds a job of this kind is judged by."""
        return self.thresholds if self.kinds is None else self.kinds.resolve(kind).thresholds


@dataclass(frozen=True, slots=True)
class PassReport:
    """The result of one pass: counts, every decision, and where the next pass resumes."""

    pass_id: int | None
    outcome: PassOutcome
    decisions: tuple[RecordedDecision, ...] = ()
    next_cursor: Cursor | None = None
    dry_run: bool = False
    shadow: bool = False
    braked: bool = False
    liveness: LivenessUnknown | None = None
    """Why the source's liveness evidence was not trusted (then the outcome is
    ``liveness_unknown`` and nothing that depends on it was decided); None: trusted."""
    held: StuckWork = field(default_factory=dict)
    """The expired jobs this pass read and held back, by reason (the stale-claim gauges)."""

    def count(self, disposition: Disposition) -> int:
        """How many decisions of this disposition the pass made."""
        return sum(1 for d in self.decisions if d.disposition is disposition)


def evidence_from(row: Candidate) -> Evidence:
    """Turn raw candidate facts into evidence; EvidenceError when they contradict or the
    source could not read them."""
    if row.unreadable:
        raise EvidenceError("the source could not read a fact", **dict(row.unreadable))
    plan = parse_plan(row.plan)
    return Evidence(
        job_id=row.job_id, attempt_count=row.attempt_count, max_attempts=row.max_attempts,
        operator_hold=row.operator_hold, lease_live=row.lease_live,
        lease_expired_seconds=row.lease_expired_seconds,
        activity_age_seconds=row.activity_age_seconds,
        plan=plan, steps=build_steps(plan, row.step_rows), session_gone=row.session_gone,
        lost_attempts_in_a_row=row.lost_attempts_in_a_row,
        completion_recoverable=row.completion_recoverable,
    )


def plan_change(row: Candidate, thresholds: Thresholds) -> PlannedChange:
    """Decide one candidate; a job that cannot be evaluated becomes ``reconcile_error``."""
    try:
        evidence = evidence_from(row)
        facts = evidence.public_facts()
        if row.owner:
            facts["owner"] = dict(row.owner)
        return PlannedChange(decide(evidence, thresholds), row.fence, thresholds, facts)
    except (EvidenceError, ValueError, TypeError) as exc:
        log.warning("event=reconcile_error job_id=%s error=%s", row.job_id, type(exc).__name__)
        return PlannedChange(
            Decision(row.job_id, Disposition.SKIP, Reason.RECONCILE_ERROR),
            row.fence, thresholds,
            {"error": type(exc).__name__, **getattr(exc, "detail", {})},
        )


def plan_changes(rows: Sequence[Candidate], config: PassConfig) -> list[PlannedChange]:
    """``plan_change`` for a batch, each row under its kind's thresholds, deciding once per
    distinct shape of facts.

    A batch holds a few shapes (plan, step states, attempts, flags) repeated many times:
    the table runs, and the evidence is built, for the first row of each shape; the other
    rows take its decision and its evidence with their own job id, fence and ages.
    ``_shape`` names every fact a rule reads (activity age only as the two comparisons the
    rules make), and tests/unit/test_plan_batch.py checks over the evidence space that the
    result equals ``plan_change`` row by row.
    """
    thresholds_of: dict[str, Thresholds] = {}
    decided: dict[tuple[Any, ...], PlannedChange] = {}
    planned: list[PlannedChange] = []
    for row in rows:
        thresholds = thresholds_of.get(row.job_kind)
        if thresholds is None:
            thresholds = thresholds_of[row.job_kind] = config.thresholds_for(row.job_kind)
        try:
            shape = _shape(row, thresholds)
            first = decided.get(shape)
        except (TypeError, ValueError):  # a fact the table cannot compare or hash
            planned.append(plan_change(row, thresholds))
            continue
        if first is None:
            change = plan_change(row, thresholds)
            # An error may come from the row's own ages, outside the shape: never shared.
            if change.decision.reason is not Reason.RECONCILE_ERROR:
                decided[shape] = change
        else:
            change = _like(first, row)
        planned.append(change)
    return planned


def _shape(row: Candidate, thresholds: Thresholds) -> tuple[Any, ...]:
    """Every fact of a candidate that ``plan_change`` reads, but its job id, fence and ages;
    the activity age as the two comparisons rules 2 and 4 make."""
    age = row.activity_age_seconds
    return (row.plan, row.step_rows, row.attempt_count, row.max_attempts, row.operator_hold,
            row.lease_live, row.session_gone, row.lost_attempts_in_a_row,
            # The kind stands for its thresholds (one per kind in a batch), hashed faster.
            row.completion_recoverable, row.unreadable, row.job_kind,
            None if age is None
            else (age < thresholds.stale_after_seconds,
                  age >= thresholds.wedged_after_seconds))


def _like(first: PlannedChange, row: Candidate) -> PlannedChange:
    """``first``'s decision and evidence for a row of the same shape: its own job id, fence
    and ages (the only facts of the evidence outside the shape)."""
    d = first.decision
    evidence = first.evidence.copy()  # the keys in the same order
    try:
        evidence["lease_expired_seconds"] = round_age(row.lease_expired_seconds)
        evidence["activity_age_seconds"] = round_age(row.activity_age_seconds)
    except (TypeError, ValueError):  # an age that cannot be rounded: the row's own error
        return plan_change(row, first.thresholds)
    if row.owner:
        evidence["owner"] = dict(row.owner)
    else:
        evidence.pop("owner", None)
    return PlannedChange(Decision(row.job_id, d.disposition, d.reason, d.resume_step_index,
                                  d.rule_number),
                         row.fence, first.thresholds, evidence)


def outcomes(planned: Sequence[PlannedChange], applied: Mapping[JobKey, int | None]
             ) -> list[RecordedDecision]:
    """What each planned change became: as decided, or skip ``fence_lost`` when its
    compare-and-swap matched nothing (the job changed between reading and applying)."""
    recorded: list[RecordedDecision] = []
    for change in planned:
        d, before = change.decision, change.generation_before
        if d.disposition is Disposition.SKIP:
            recorded.append(RecordedDecision(d.job_id, d.disposition, d.reason,
                                             d.resume_step_index, before, None))
        elif d.job_id in applied:
            recorded.append(RecordedDecision(d.job_id, d.disposition, d.reason,
                                             d.resume_step_index, before, applied[d.job_id]))
        else:
            recorded.append(RecordedDecision(d.job_id, Disposition.SKIP, Reason.FENCE_LOST,
                                             None, before, None))
    return recorded


@dataclass(frozen=True, slots=True)
class Explained:
    """One running job as a pass would judge it now, with what the views need beside the
    table's verdict to tell the same story as the pass."""

    job_kind: str
    """Its kind, whose ``[kinds]`` rules apply."""
    change: PlannedChange
    liveness: LivenessUnknown | None
    """Why its source's liveness is not trusted now (None: it is): then a pass leaves a
    job the table finds live alone for that reason, not because its owner is alive."""
    leases_own: bool
    """Whether its source keeps a lease or an owner's liveness for it (False: only its
    kind's ``max_run_seconds`` can end it)."""


def explain_jobs(store: PassStore, job_ids: Sequence[JobKey], config: PassConfig
                 ) -> list[PlannedChange]:
    """What the table decides for named running jobs now; reads only, writes nothing.

    Unlike a pass it looks at jobs whatever their lease, so an operator can ask why a
    live job is left alone (``lease_live``) as well as what would happen to a stale one.
    """
    return [explained.change for explained in explain_by_kind(store, job_ids, config)]


def explain_by_kind(store: PassStore, job_ids: Sequence[JobKey], config: PassConfig
                    ) -> list[Explained]:
    """``explain_jobs``, each change with its kind and its source's liveness and lease."""
    with store.pass_transaction(dry_run=True) as tx:
        changes = [(row.job_kind, plan_change(row, config.thresholds_for(row.job_kind)))
                   for row in with_holds(tx, tx.jobs.evidence_for(job_ids))]
        liveness, leases_own = tx.jobs.liveness_unknown(), tx.jobs.leases_own()
        return [Explained(kind, change, liveness, leases_own) for kind, change in changes]


def run_pass(
    store: PassStore, config: PassConfig, *, dry_run: bool = False, after: Cursor | None = None
) -> PassReport:
    """Run one bounded pass: select, decide, compare-and-swap, record; one transaction.

    The pass row, every decision and every change commit together, so a crash mid-pass
    leaves nothing half-applied and nothing applied without its record.
    """
    with _collections_deferred():
        # A pass the database rolled back to break a deadlock applied nothing: it runs again.
        return retried(lambda: _run_pass(store, config, dry_run=dry_run, after=after))


@contextmanager
def _collections_deferred() -> Iterator[None]:
    """No cyclic garbage collection while a pass runs (when it was on, it is on again after).

    A batch allocates some twenty containers a job (rows, candidates, decisions, the JSON
    rows) that all live until the pass ends. Collections during the pass walk them and
    promote them to the oldest generation, whose collection then walks every long-lived
    object of the process: 15% of a pass's CPU time, measured (docs/benchmarks.md). Once
    the pass returns, reference counting frees them and the collector has nothing left to
    do; a cycle a pass made is collected by the next collection after it.
    """
    if not gc.isenabled():  # the process chose to collect by itself, or a pass in another
        yield               # thread deferred collection already: leave it to them
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _run_pass(store: PassStore, config: PassConfig, *, dry_run: bool, after: Cursor | None
              ) -> PassReport:
    if dry_run:
        with store.pass_transaction(dry_run=True) as tx:
            rows = tx.jobs.candidates(config.batch_size, config.thresholds, after)
            planned = plan_changes(with_holds(tx, rows), config)
            braked = False
            if config.brake is not None and planned:
                # The brake as the pass would apply it; its state is read, never kept.
                planned, braked = brake_planned(tx, config.brake, planned, keep=False)
            liveness = tx.jobs.liveness_unknown()
        previewed = tuple(
            RecordedDecision(p.decision.job_id, p.decision.disposition, p.decision.reason,
                             p.decision.resume_step_index, p.generation_before, None)
            for p in planned
        )
        return PassReport(None, outcome_of(liveness), previewed, dry_run=True, braked=braked,
                          liveness=liveness, held=held_back(planned))

    with store.pass_transaction(dry_run=False) as tx:
        # No leader gate: every replica passes. Candidates are locked with SKIP LOCKED on
        # PostgreSQL (replicas share a backlog) and SQLite's write lock serialises passes;
        # each job's compare-and-swap is what makes a decision count once.
        if not config.shadow:  # declaring owners gone expires their jobs' leases: a change
            tx.jobs.expire_gone_owners(config.session_timeout_seconds)
        rows = tx.jobs.candidates(config.batch_size, config.thresholds, after)
        liveness = tx.jobs.liveness_unknown()
        outcome = outcome_of(liveness)
        if not rows:
            # Nothing stale: the pass row is the whole record, written in one statement,
            # and any staleness event the brake remembered is over.
            if config.brake is not None:
                tx.lease.keep_brake(None)
            pass_id = tx.audit.record_quiet_pass(config.instance, outcome)
            return PassReport(pass_id, outcome, shadow=config.shadow, liveness=liveness)
        planned = plan_changes(with_holds(tx, rows), config)
        braked = False
        if config.brake is not None:
            planned, braked = brake_planned(tx, config.brake, planned)
        failpoints.hit("between_decide_and_apply")
        pass_id, recorded = apply_and_record(tx, config.instance, planned,
                                             shadow=config.shadow, outcome=outcome)
    return PassReport(pass_id, outcome, tuple(recorded), next_cursor(rows, config),
                      shadow=config.shadow, braked=braked, liveness=liveness,
                      held=held_back(planned))


def with_holds(tx: PassUnit, rows: Sequence[Candidate]) -> Sequence[Candidate]:
    """The candidates, those an operator holds by the reconciler's own hold (a foreign
    job's, kept in this project's tables) marked held: the table then skips them with
    ``operator_hold``, recorded once, as it does a native job its row holds."""
    if not rows:
        return rows
    held = tx.audit.held_among(tx.jobs.source_name, [row.job_id for row in rows])
    if not held:
        return rows
    return [replace(row, operator_hold=True) if str(row.job_id) in held else row
            for row in rows]


def outcome_of(liveness: LivenessUnknown | None) -> PassOutcome:
    """A pass's outcome: ``liveness_unknown`` when its source's liveness was not trusted."""
    return PassOutcome.OK if liveness is None else PassOutcome.LIVENESS_UNKNOWN


def brake_planned(tx: PassUnit, limits: BrakeLimits, planned: list[PlannedChange], *,
                  keep: bool = True) -> tuple[list[PlannedChange], bool]:
    """Apply the mass-staleness brake to a batch: when so many running jobs went stale at
    once that an outage is likelier than mass death, every change becomes a skip
    ``mass_staleness_brake`` for the hold. The event's start is kept in the database, so
    every replica and a restarted one brake alike. A batch that would change nothing, or a
    brake with no hold, costs no count. ``keep=False`` (a dry run) reads the event's start
    without keeping it."""
    # A hold of 0 never brakes (``brake``): counting would change nothing.
    if limits.hold_seconds == 0 or all(p.decision.disposition is Disposition.SKIP
                                       for p in planned):
        return planned, False
    running = tx.jobs.running_count()
    stale = tx.jobs.stale_count(count_limit(running, limits))
    since, now = tx.lease.brake_state()
    state = brake(stale, running, limits, since, now)
    if keep and state.engaged_since != since:
        tx.lease.keep_brake(state.engaged_since)
    if not state.engaged:
        return planned, False
    held = apply_brake([p.decision for p in planned])
    return [replace(p, decision=d) for p, d in zip(planned, held, strict=True)], True


def apply_and_record(tx: PassUnit, instance: str, planned: Sequence[PlannedChange], *,
                     shadow: bool = False, outcome: PassOutcome = PassOutcome.OK
                     ) -> tuple[int, list[RecordedDecision]]:
    """Start a pass record, compare-and-swap the non-skip changes through the source, and
    record every decision as it turned out; the pass id and the recorded decisions.

    In shadow mode nothing is applied: every decision is recorded as decided, marked
    shadow, with no generation after.
    """
    pass_id = tx.audit.start_pass(instance)
    if shadow:
        recorded = [RecordedDecision(p.decision.job_id, p.decision.disposition,
                                     p.decision.reason, p.decision.resume_step_index,
                                     p.generation_before, None) for p in planned]
    else:
        acting = [p for p in planned if p.decision.disposition is not Disposition.SKIP]
        applied = tx.jobs.apply(acting) if acting else {}
        failpoints.hit("between_apply_and_record")
        recorded = outcomes(planned, applied)
    repeated = tx.audit.finish_pass(
        pass_id, tx.jobs.source_name,
        [(r, p.evidence) for r, p in zip(recorded, planned, strict=True)],
        shadow=shadow, outcome=outcome)
    if repeated:
        recorded = [replace(r, repeated=True) if (str(r.job_id), r.reason.value) in repeated
                    else r for r in recorded]
    if not shadow:  # parking writes a job row; shadow mode changes none
        parking = [p for p in planned if p.decision.disposition is Disposition.SKIP
                   and p.decision.reason in PARKING_REASONS]
        if parking:
            tx.jobs.park(parking)
    return pass_id, recorded


def next_cursor(rows: Sequence[Candidate], config: PassConfig) -> Cursor | None:
    """Where the next pass's scans continue after a full batch: after the last row each
    scan gave; None once a batch came back short (the sweep is done and starts over).

    Both scans page, so neither skipped expired jobs (recent activity, the brake) nor
    skipped wedged ones (shadow mode, the brake) can starve the jobs behind them; leases
    that expire later sort after the cursor, so they are not passed over either.
    """
    if len(rows) < config.batch_size:
        return None
    expired = [r.position.position for r in rows
               if r.position is not None and r.position.position is not None]
    wedged = [r.position.wedged for r in rows
              if r.position is not None and r.position.wedged is not None]
    if not expired and not wedged:
        return None
    return Cursor(expired[-1] if expired else None, wedged[-1] if wedged else None)
