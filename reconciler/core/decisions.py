"""The decision table: evidence in, decision out. Pure: no I/O, no clock.

``RULES`` is the one ordered list. ``decide`` returns the decision of the first rule that
matches; ``reconciler explain`` and docs/decision-table.md print the same list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from reconciler.core.evidence import Evidence
from reconciler.core.vocabulary import Disposition, EffectKind, JobKey, JobStatus, Reason, StepState


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The limits the table compares evidence against: ages in seconds, counts of attempts.

    Built from the settings by ``Settings.thresholds()``, where every default is declared.
    ``crash_loop_after`` None (a caller that does not pass the setting) turns the crash-loop
    rule off; a per-kind policy passes its own value with ``dataclasses.replace``.
    """

    stale_after_seconds: float
    wedged_after_seconds: float
    crash_loop_after: int | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do with one job. ``resume_step_index`` is set only for resumes."""

    job_id: JobKey
    disposition: Disposition
    reason: Reason
    resume_step_index: int | None = None
    rule_number: int | None = None

    @property
    def status_after(self) -> JobStatus | None:
        """The status applying this decision gives the job; None for a skip."""
        return _STATUS_AFTER[self.disposition, self.reason]


def status_after(disposition: Disposition, reason: Reason) -> JobStatus | None:
    """The job status a decision leads to: ``queued`` for a resume; ``completed`` for the one
    terminalization that finishes work done (``completion_recovered``), ``failed`` for the
    others; None for a skip, which changes nothing."""
    if disposition is Disposition.RESUME:
        return JobStatus.QUEUED
    if disposition is Disposition.TERMINALIZE:
        return JobStatus.COMPLETED if reason is Reason.COMPLETION_RECOVERED else JobStatus.FAILED
    return None


# Every pair answered once: the pass asks for each decision it applies, and a lookup costs
# a tenth of the three enum comparisons.
_STATUS_AFTER: dict[tuple[Disposition, Reason], JobStatus | None] = {
    (d, r): status_after(d, r) for d in Disposition for r in Reason}


Predicate = Callable[[Evidence, Thresholds], bool]


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the table: when it matches, what it decides, and why, in one line."""

    number: int
    disposition: Disposition
    reason: Reason
    evidence: str
    description: str
    matches: Predicate
    resumes: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "resumes", self.disposition is Disposition.RESUME)


def _held(ev: Evidence, _t: Thresholds) -> bool:
    return ev.operator_hold


def _wedged(ev: Evidence, t: Thresholds) -> bool:
    return (
        ev.lease_live
        and not ev.session_gone
        and ev.activity_age_seconds is not None
        and ev.activity_age_seconds >= t.wedged_after_seconds
    )


def _lease_live(ev: Evidence, _t: Thresholds) -> bool:
    return ev.lease_live and not ev.session_gone


def _recent_activity(ev: Evidence, t: Thresholds) -> bool:
    return (
        not ev.session_gone
        and ev.activity_age_seconds is not None
        and ev.activity_age_seconds < t.stale_after_seconds
    )


def _plan_unreadable(ev: Evidence, _t: Thresholds) -> bool:
    return ev.plan is None


def _first_state_is(state: StepState) -> Predicate:
    def matches(ev: Evidence, _t: Thresholds) -> bool:
        record = ev.first_unfinished
        return record is not None and record.step_state is state

    return matches


def _all_succeeded(ev: Evidence, _t: Thresholds) -> bool:
    return ev.first_unfinished_index is None


def _completion_recoverable(ev: Evidence, _t: Thresholds) -> bool:
    return ev.first_unfinished_index is None and ev.completion_recoverable


def _failed_for_good(ev: Evidence, _t: Thresholds) -> bool:
    record = ev.first_unfinished
    return (
        record is not None
        and record.step_state is StepState.FAILED
        and not record.failure_retryable
    )


_first_started = _first_state_is(StepState.STARTED)


def _died_in_effect(ev: Evidence, t: Thresholds) -> bool:
    return _first_started(ev, t) and ev.first_unfinished_effect is EffectKind.EFFECTFUL


def _crash_loop(ev: Evidence, t: Thresholds) -> bool:
    return t.crash_loop_after is not None and ev.lost_attempts_in_a_row >= t.crash_loop_after


def _exhausted(ev: Evidence, _t: Thresholds) -> bool:
    return ev.attempt_count >= ev.max_attempts


def _always(_ev: Evidence, _t: Thresholds) -> bool:
    return True


# ORDER_NOTES (below, printed in the docs) says why completion_recovered and crash_loop
# sit where they do.
RULES: tuple[Rule, ...] = (
    Rule(1, Disposition.SKIP, Reason.OPERATOR_HOLD, "operator hold set",
         "an operator holds the job; the reconciler leaves it alone", _held),
    Rule(2, Disposition.TERMINALIZE, Reason.WORKER_WEDGED,
         "lease live, but no activity for wedged_after_seconds",
         "a heartbeat without progress hides a hung handler; ended failed, never requeued, "
         "since the hung copy may still run", _wedged),
    Rule(3, Disposition.SKIP, Reason.LEASE_LIVE, "lease live (and its worker session not gone)",
         "its worker is alive and renewing the lease", _lease_live),
    Rule(4, Disposition.SKIP, Reason.RECENT_ACTIVITY,
         "activity newer than stale_after_seconds (and its worker session not gone)",
         "the job moved recently; wait before judging it dead", _recent_activity),
    Rule(5, Disposition.TERMINALIZE, Reason.UNRESUMABLE_PLAN, "step plan missing or unreadable",
         "without a readable plan no step can safely be resumed", _plan_unreadable),
    Rule(6, Disposition.SKIP, Reason.WAITING_ON_GATE, "first unfinished step is waiting",
         "the job waits on an external gate, not on its worker",
         _first_state_is(StepState.WAITING)),
    Rule(7, Disposition.TERMINALIZE, Reason.COMPLETION_RECOVERED,
         "every step succeeded, completion not recorded, and the source can record it "
         "(native source, that generation's artifacts all staged)",
         "all work is done and completing is a fenced status flip plus publishing the staged "
         "artifacts, both safe to do again; ended completed, not failed",
         _completion_recoverable),
    Rule(8, Disposition.TERMINALIZE, Reason.COMPLETION_UNRECORDED,
         "every step succeeded, completion not recorded",
         "all work is done but the worker died before recording completion, and the source "
         "cannot record it for the worker", _all_succeeded),
    Rule(9, Disposition.TERMINALIZE, Reason.STEP_FAILED,
         "first unfinished step failed, not retryable",
         "the worker recorded a permanent step failure, then died", _failed_for_good),
    Rule(10, Disposition.TERMINALIZE, Reason.WORKER_DIED_MID_STEP,
         "first unfinished step started, effectful",
         "its side effect may or may not have happened; running it again could repeat it",
         _died_in_effect),
    Rule(11, Disposition.TERMINALIZE, Reason.CRASH_LOOP,
         "the last crash_loop_after attempts were all lost (this one included)",
         "the job kills the workers that run it; not resumed into its next victim (after the "
         "rules that say more, before the budget and the resumes)", _crash_loop),
    Rule(12, Disposition.TERMINALIZE, Reason.RESUME_EXHAUSTED, "attempts used >= max attempts",
         "the shared attempt budget (retries and resumes) is spent", _exhausted),
    Rule(13, Disposition.RESUME, Reason.RESUMED_IDEMPOTENT_STEP,
         "first unfinished step started, pure/idempotent",
         "the interrupted step is safe to run again; resume at it", _first_started),
    Rule(14, Disposition.RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP,
         "otherwise (first unfinished step never started)",
         "nothing of the next step was applied (or it failed retryably); resume at it",
         _always),
)


def decide(ev: Evidence, thresholds: Thresholds) -> Decision:
    """Apply the ordered table to one job's evidence; the first matching rule decides."""
    for rule in RULES:
        if rule.matches(ev, thresholds):
            resume_at = ev.first_unfinished_index if rule.resumes else None
            return Decision(ev.job_id, rule.disposition, rule.reason, resume_at, rule.number)
    raise AssertionError("the last rule matches everything")  # pragma: no cover


ORDER_NOTES: tuple[tuple[Reason, str], ...] = (
    (Reason.COMPLETION_RECOVERED,
     "before completion_unrecorded, whose evidence it narrows: when the source can finish "
     "work that was done, it does. Its disposition is terminalize because it ends the job in "
     "a terminal status (completed) and fences the dead worker out like every "
     "terminalization; a resume would run steps again and a skip would change nothing."),
    (Reason.CRASH_LOOP,
     "after every rule that says more than \"it keeps dying\": a live or held job (1-4), no "
     "plan (a retry cannot help), a gate (the job runs no code), finished work (no step left "
     "to run), a recorded permanent failure, and an effect in doubt (it must be checked "
     "before any retry, so a crash-loop job never has one). Before resume_exhausted, which "
     "would only say the budget ran out, and before the resumes, which would hand the job to "
     "its next victim."),
)
"""The order of the rules added with crash loops and recovered completions, explained once
for the docs (``render_markdown``)."""

_BRAKE_TEXT = ("too many jobs went stale at once (at least brake_min_jobs, and at least "
               "brake_stale_fraction of the running jobs), more likely a database, network or "
               "clock event than mass death: for brake_hold_seconds from the first braked pass, "
               "every resume or terminalization is recorded as this skip instead and changes "
               "nothing; jobs still stale after that are decided by the rules.")
_SHADOW_TEXT = ("In shadow mode (shadow = true) a pass decides by these rules and records "
                "every decision marked shadow, and changes no job.")


def render_table() -> str:
    """The table as aligned text, for ``reconciler explain``."""
    lines = [f"{'#':>2}  {'disposition':<11}  {'reason':<28}  evidence / why"]
    for rule in RULES:
        lines.append(
            f"{rule.number:>2}  {rule.disposition.value:<11}  {rule.reason.value:<28}  "
            f"{rule.evidence}"
        )
        lines.append(f"{'':>2}  {'':<11}  {'':<28}  -> {rule.description}")
    lines.append("")
    lines.append("Outcomes of the pass itself (not rules):")
    lines.append(f"    skip         {Reason.FENCE_LOST.value:<28}  the job changed between "
                 "reading and applying (compare-and-swap matched no row); nothing changed")
    lines.append(f"    skip         {Reason.RECONCILE_ERROR.value:<28}  the job's evidence could "
                 "not be read; recorded, the pass goes on")
    lines.append(f"    skip         {Reason.MASS_STALENESS_BRAKE.value:<28}  "
                 f"{_BRAKE_TEXT}")
    lines.append("")
    lines.append(_SHADOW_TEXT)
    return "\n".join(lines)


def render_markdown() -> str:
    """The table as Markdown, for docs/decision-table.md (generated, checked by a test)."""
    rows = [
        "# The decision table",
        "",
        "<!-- Generated by `reconciler explain --markdown`; do not edit by hand. -->",
        "",
        "The reconciler examines each processing job whose lease expired (or that shows no",
        "activity for `wedged_after_seconds` under a live lease). The rules are tried in order;",
        "the first that matches decides. Ages come from the database's clock.",
        "",
        "| # | evidence | disposition | reason | why |",
        "|---|---|---|---|---|",
    ]
    rows += [
        f"| {r.number} | {r.evidence} | {r.disposition.value} | `{r.reason.value}` | "
        f"{r.description} |"
        for r in RULES
    ]
    rows += [
        "",
        "Outcomes of the pass itself, recorded like decisions:",
        "",
        f"- `{Reason.FENCE_LOST.value}` (skip): the job changed between reading and applying; "
        "the compare-and-swap matched no row and nothing changed.",
        f"- `{Reason.RECONCILE_ERROR.value}` (skip): the job's evidence could not be read "
        "(for example a step record outside its plan); the pass goes on with the others.",
        f"- `{Reason.MASS_STALENESS_BRAKE.value}` (skip): {_BRAKE_TEXT}",
        "",
        _SHADOW_TEXT,
        "",
        "Why some rules sit where they do:",
        "",
        *(f"- `{reason.value}`: {why}" for reason, why in ORDER_NOTES),
    ]
    return "\n".join(rows) + "\n"
