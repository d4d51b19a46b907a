"""The decision table: evidence in, one decision out, first rule wins.

The oracle below is an independent transcription of the table as a plain if/elif chain: it
never reads ``RULES`` nor ``Evidence``'s derived properties, so a reordered table, a wrong
predicate or a wrong "first unfinished step" is caught by comparing against it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.core import decisions
from reconciler.core.decisions import RULES, Decision, Rule, Thresholds, decide, status_after
from reconciler.core.evidence import Evidence, PlanStep, StepRecord
from reconciler.core.vocabulary import Disposition, EffectKind, JobStatus, Reason, StepState

REPO_ROOT = Path(__file__).resolve().parents[2]

STALE = 60.0
WEDGED = 3600.0
CRASH_LOOP_AFTER = 2  # the settings' default
THRESHOLDS = Thresholds(stale_after_seconds=STALE, wedged_after_seconds=WEDGED,
                        crash_loop_after=CRASH_LOOP_AFTER)

# The decision table, transcribed by hand, with the two rules issue 13 added:
# completion_recovered before completion_unrecorded, crash_loop before the resume rules.
# (number, evidence, disposition, reason).
DESIGN_TABLE: tuple[tuple[int, str, str, str], ...] = (
    (1, "operator hold set", "skip", "operator_hold"),
    (2, "lease live, but no activity for `wedged_after_seconds`", "terminalize",
     "worker_wedged"),
    (3, "lease live (and its worker session not gone)", "skip", "lease_live"),
    (4, "activity newer than `stale_after_seconds`", "skip", "recent_activity"),
    (5, "step plan missing or unreadable", "terminalize", "unresumable_plan"),
    (6, "first unfinished step is `waiting`", "skip", "waiting_on_gate"),
    (7, "every step succeeded, completion not recorded, and the source can record it",
     "terminalize", "completion_recovered"),
    (8, "every step succeeded, completion not recorded", "terminalize",
     "completion_unrecorded"),
    (9, "first unfinished step failed, not retryable", "terminalize", "step_failed"),
    (10, "first unfinished step started, `effectful`", "terminalize", "worker_died_mid_step"),
    (11, "the last `crash_loop_after` attempts were all lost", "terminalize", "crash_loop"),
    (12, "attempts used >= max attempts", "terminalize", "resume_exhausted"),
    (13, "first unfinished step started, `pure`/`idempotent`", "resume",
     "resumed_idempotent_step"),
    (14, "otherwise (first unfinished step never started)", "resume",
     "resumed_from_unstarted_step"),
)
SECTION_11_REASONS = frozenset({"completion_recovered", "crash_loop"})
RULE_COUNT = len(DESIGN_TABLE)
RULE_NUMBERS = range(1, RULE_COUNT + 1)
RULE_REASONS = frozenset(reason for _, _, _, reason in DESIGN_TABLE)
PASS_OUTCOME_REASONS = frozenset({"fence_lost", "reconcile_error", "mass_staleness_brake"})


# --------------------------------------------------------------------------------------
# The oracle: the decision table written out plainly.
# --------------------------------------------------------------------------------------


def _first_unfinished_by_hand(ev: Evidence) -> tuple[int | None, StepRecord | None, str | None]:
    """(index, record or None, effect kind) of the first plan step not succeeded."""
    if ev.plan is None:
        return None, None, None
    for index, step in enumerate(ev.plan):
        record = ev.steps.get(index)
        if record is None or record.step_state != "succeeded":
            return index, record, str(step.effect_kind)
    return None, None, None


def design_table(  # noqa: PLR0912 - the oracle is the table as one plain if/elif chain
    ev: Evidence, stale: float, wedged: float, crash_loop_after: int | None = CRASH_LOOP_AFTER,
) -> tuple[str, int | None]:
    """The reason and resume step the decision table gives for this evidence.

    Interpretations the table leaves implicit, written down here:
    - a claim whose worker session is gone is "treated as expired at once" (section 3a): its
      lease does not count as live (rules 2 and 3) and its recent activity does not make the
      reconciler wait (rule 4) - the worker is known to be dead;
    - "no activity for wedged_after_seconds" means an age >= the threshold; an unknown age
      (no activity recorded) is neither wedged nor recent;
    - a failed step counts as retryable only when recorded as retryable (unknown = not);
    - "the last crash_loop_after attempts were all lost" means lost_attempts_in_a_row (which
      counts the attempt being decided) is at least crash_loop_after; no threshold, no rule;
    - the source's "can record completion" flag counts only when every step succeeded.
    """
    lease_live = ev.lease_live and not ev.session_gone
    age = ev.activity_age_seconds
    first, record, effect = _first_unfinished_by_hand(ev)
    state = None if record is None else str(record.step_state)

    if ev.operator_hold:
        return "operator_hold", None
    elif lease_live and age is not None and age >= wedged:
        return "worker_wedged", None
    elif lease_live:
        return "lease_live", None
    elif not ev.session_gone and age is not None and age < stale:
        return "recent_activity", None
    elif ev.plan is None:
        return "unresumable_plan", None
    elif first is not None and state == "waiting":
        return "waiting_on_gate", None
    elif first is None and ev.completion_recoverable:
        return "completion_recovered", None
    elif first is None:
        return "completion_unrecorded", None
    elif state == "failed" and record is not None and record.failure_retryable is not True:
        return "step_failed", None
    elif state == "started" and effect == "effectful":
        return "worker_died_mid_step", None
    elif crash_loop_after is not None and ev.lost_attempts_in_a_row >= crash_loop_after:
        return "crash_loop", None
    elif ev.attempt_count >= ev.max_attempts:
        return "resume_exhausted", None
    elif state == "started" and effect in ("pure", "idempotent"):
        return "resumed_idempotent_step", first
    else:
        return "resumed_from_unstarted_step", first


# Each row's evidence on its own (not the ordering), for the pairwise order checks.
RowCondition = Callable[[Evidence], bool]


def _live(ev: Evidence) -> bool:
    return ev.lease_live and not ev.session_gone


def _first_state(ev: Evidence) -> str | None:
    _, record, _ = _first_unfinished_by_hand(ev)
    return None if record is None else str(record.step_state)


def _first_effect(ev: Evidence) -> str | None:
    return _first_unfinished_by_hand(ev)[2]


def _has_unfinished(ev: Evidence) -> bool:
    return _first_unfinished_by_hand(ev)[0] is not None


def _age_at_least(ev: Evidence, limit: float) -> bool:
    return ev.activity_age_seconds is not None and ev.activity_age_seconds >= limit


def _failed_for_good(ev: Evidence) -> bool:
    record = _first_unfinished_by_hand(ev)[1]
    return (record is not None and record.step_state == "failed"
            and record.failure_retryable is not True)


ROW_CONDITIONS: dict[int, RowCondition] = {
    1: lambda ev: ev.operator_hold,
    2: lambda ev: _live(ev) and _age_at_least(ev, WEDGED),
    3: _live,
    4: lambda ev: (not ev.session_gone and ev.activity_age_seconds is not None
                   and ev.activity_age_seconds < STALE),
    5: lambda ev: ev.plan is None,
    6: lambda ev: _first_state(ev) == "waiting",
    7: lambda ev: ev.plan is not None and not _has_unfinished(ev) and ev.completion_recoverable,
    8: lambda ev: ev.plan is not None and not _has_unfinished(ev),
    9: _failed_for_good,
    10: lambda ev: _first_state(ev) == "started" and _first_effect(ev) == "effectful",
    11: lambda ev: ev.lost_attempts_in_a_row >= CRASH_LOOP_AFTER,
    12: lambda ev: ev.attempt_count >= ev.max_attempts,
    13: lambda ev: _first_state(ev) == "started" and _first_effect(ev) in ("pure", "idempotent"),
    14: lambda ev: True,  # "otherwise"
}

# Pairs of rows whose evidence cannot hold at once, and why. Their relative order cannot
# be observed; the pairwise test checks that this list is exactly right. Every other pair,
# crash_loop (11) with each rule and completion_recovered (7) with completion_unrecorded
# (8) among them, has grid evidence matching both, on which the earlier rule must win.
_NO_PLAN = "without a plan there is no first unfinished step (nor all steps succeeded)"
_ALL_DONE = "when every step succeeded there is no unfinished step"
_ONE_STATE = "the first unfinished step has one state"
CANNOT_CO_OCCUR: dict[tuple[int, int], str] = {
    (2, 4): "an age >= wedged_after_seconds is never < stale_after_seconds (stale < wedged)",
    (5, 6): _NO_PLAN, (5, 7): _NO_PLAN, (5, 8): _NO_PLAN, (5, 9): _NO_PLAN, (5, 10): _NO_PLAN,
    (5, 13): _NO_PLAN,
    (6, 7): "a waiting step is an unfinished step",
    (6, 8): "a waiting step is an unfinished step",
    (6, 9): _ONE_STATE, (6, 10): _ONE_STATE, (6, 13): _ONE_STATE,
    (7, 9): _ALL_DONE, (7, 10): _ALL_DONE, (7, 13): _ALL_DONE,
    (8, 9): _ALL_DONE, (8, 10): _ALL_DONE, (8, 13): _ALL_DONE,
    (9, 10): _ONE_STATE, (9, 13): _ONE_STATE,
    (10, 13): "a step is effectful or pure/idempotent, never both",
}


# --------------------------------------------------------------------------------------
# Evidence builders and the feature grid.
# --------------------------------------------------------------------------------------

PLAN3 = (
    PlanStep("fetch", EffectKind.IDEMPOTENT),
    PlanStep("render", EffectKind.PURE),
    PlanStep("publish", EffectKind.EFFECTFUL),
)


def evidence(
    *,
    hold: bool = False,
    lease_live: bool = False,
    session_gone: bool = False,
    age: float | None = 600.0,
    plan: tuple[PlanStep, ...] | None = PLAN3,
    steps: Mapping[int, StepRecord] | None = None,
    attempts: int = 1,
    max_attempts: int = 3,
    lost: int = 1,
    recoverable: bool = False,
) -> Evidence:
    """Evidence of an expired, stale, resumable job unless told otherwise.

    By default only the attempt being decided was lost (``lost=1``), below the crash-loop
    threshold, and the source cannot record completion itself.
    """
    return Evidence(
        job_id=7, attempt_count=attempts, max_attempts=max_attempts,
        operator_hold=hold, lease_live=lease_live,
        lease_expired_seconds=None if lease_live else 120.0,
        activity_age_seconds=age, plan=plan, steps=dict(steps or {}), session_gone=session_gone,
        lost_attempts_in_a_row=lost, completion_recoverable=recoverable,
    )


def done(*indices: int) -> dict[int, StepRecord]:
    """Records saying these steps succeeded."""
    return {i: StepRecord(i, StepState.SUCCEEDED) for i in indices}


AGES: tuple[float | None, ...] = (
    None, 0.0, STALE - 0.001, STALE, 1800.0, WEDGED - 0.001, WEDGED, 86_400.0,
)
# (state of the first unfinished step, failure_retryable); None state = never started.
FIRST_STATES: tuple[tuple[StepState | None, bool | None], ...] = (
    (None, None),
    (StepState.STARTED, None),
    (StepState.FAILED, True),
    (StepState.FAILED, False),
    (StepState.FAILED, None),
    (StepState.WAITING, None),
)
ATTEMPTS = ((1, 3), (2, 3), (3, 3), (5, 3))
# Lost attempts in a row: just under and at the crash-loop threshold (0 and 1 decide alike,
# as do 2 and more; the boundary is what a wrong comparison would move).
LOST = (CRASH_LOOP_AFTER - 1, CRASH_LOOP_AFTER)

PlanVariant = tuple[str, tuple[PlanStep, ...] | None, dict[int, StepRecord], bool]


def _plan_variants() -> Iterator[PlanVariant]:
    """(label, plan, step records, whether the source says it can record completion)."""
    yield "no-plan", None, {}, False
    yield "all-succeeded", PLAN3, done(0, 1, 2), False
    yield "all-succeeded:recoverable", PLAN3, done(0, 1, 2), True
    # The flag without every step succeeded (a source's mistake) recovers nothing.
    yield "no-plan:recoverable", None, {}, True
    yield "first=1:None:recoverable", PLAN3, done(0), True
    for position, (state, retryable), kind, trailing in itertools.product(
        (0, 1), FIRST_STATES, EffectKind, (False, True)
    ):
        plan = tuple(
            PlanStep(s.step_name, kind) if i == position else s for i, s in enumerate(PLAN3)
        )
        steps = done(*range(position))
        if state is not None:
            steps[position] = StepRecord(position, state, retryable)
        if trailing:  # a later step's record never matters: only the first unfinished does
            steps[2] = StepRecord(2, StepState.STARTED)
        label = f"first={position}:{state}:{retryable}:{kind}:trailing={trailing}"
        yield label, plan, steps, False


@cache
def grid() -> tuple[tuple[str, Evidence], ...]:
    """Every combination of the features the table reads."""
    points = []
    for hold, live, gone, age, (label, plan, steps, recoverable), (used, most), lost in (
        itertools.product((False, True), (False, True), (False, True), AGES,
                          tuple(_plan_variants()), ATTEMPTS, LOST)
    ):
        ev = evidence(hold=hold, lease_live=live, session_gone=gone, age=age, plan=plan,
                      steps=steps, attempts=used, max_attempts=most, lost=lost,
                      recoverable=recoverable)
        points.append((f"hold={hold} live={live} gone={gone} age={age} {label} "
                       f"attempts={used}/{most} lost={lost}", ev))
    return tuple(points)


def disagreements(limit: int = 5) -> list[str]:
    """Grid points where decide() and the oracle differ (at most ``limit``)."""
    found = []
    for label, ev in grid():
        got = decide(ev, THRESHOLDS)
        want = design_table(ev, STALE, WEDGED)
        if (got.reason.value, got.resume_step_index) != want:
            found.append(f"{label}: decide={got.reason.value}@{got.resume_step_index} "
                         f"design={want[0]}@{want[1]}")
            if len(found) >= limit:
                break
    return found


@cache
def pair_witnesses() -> dict[tuple[int, int], tuple[Evidence, ...]]:
    """For each pair i<j: grid evidence matching rows i and j and no row before i."""
    witnesses: dict[tuple[int, int], list[Evidence]] = {
        pair: [] for pair in itertools.combinations(RULE_NUMBERS, 2)
    }
    for _, ev in grid():
        matched = [n for n in RULE_NUMBERS if ROW_CONDITIONS[n](ev)]
        first = matched[0]
        for later in matched[1:]:
            witnesses[(first, later)].append(ev)
    return {pair: tuple(evs) for pair, evs in witnesses.items()}


def _table_with(rules: tuple[Rule, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decisions, "RULES", rules)


def _swapped(i: int, j: int) -> tuple[Rule, ...]:
    rules = list(RULES)
    rules[i - 1], rules[j - 1] = rules[j - 1], rules[i - 1]
    return tuple(rules)


def _replaced(number: int, matches: Callable[[Evidence, Thresholds], bool]) -> tuple[Rule, ...]:
    return tuple(dataclasses.replace(r, matches=matches) if r.number == number else r
                 for r in RULES)


# --------------------------------------------------------------------------------------
# Each rule is reached.
# --------------------------------------------------------------------------------------

REACH_CASES = [
    pytest.param(evidence(hold=True, lease_live=True, age=0.0),
                 1, "skip", "operator_hold", None, id="1-operator_hold"),
    pytest.param(evidence(lease_live=True, age=WEDGED),
                 2, "terminalize", "worker_wedged", None, id="2-worker_wedged"),
    pytest.param(evidence(lease_live=True, age=WEDGED - 1),
                 3, "skip", "lease_live", None, id="3-lease_live"),
    pytest.param(evidence(age=STALE - 1),
                 4, "skip", "recent_activity", None, id="4-recent_activity"),
    pytest.param(evidence(plan=None),
                 5, "terminalize", "unresumable_plan", None, id="5-unresumable_plan"),
    pytest.param(evidence(steps={**done(0), 1: StepRecord(1, StepState.WAITING)}),
                 6, "skip", "waiting_on_gate", None, id="6-waiting_on_gate"),
    pytest.param(evidence(steps=done(0, 1, 2), recoverable=True),
                 7, "terminalize", "completion_recovered", None, id="7-completion_recovered"),
    pytest.param(evidence(steps=done(0, 1, 2)),
                 8, "terminalize", "completion_unrecorded", None, id="8-completion_unrecorded"),
    pytest.param(evidence(steps={**done(0), 1: StepRecord(1, StepState.FAILED, False)}),
                 9, "terminalize", "step_failed", None, id="9-step_failed"),
    pytest.param(evidence(steps={**done(0, 1), 2: StepRecord(2, StepState.STARTED)}),
                 10, "terminalize", "worker_died_mid_step", None, id="10-worker_died_mid_step"),
    pytest.param(evidence(steps={**done(0), 1: StepRecord(1, StepState.STARTED)}, lost=2),
                 11, "terminalize", "crash_loop", None, id="11-crash_loop"),
    pytest.param(evidence(steps=done(0), attempts=3, max_attempts=3),
                 12, "terminalize", "resume_exhausted", None, id="12-resume_exhausted"),
    pytest.param(evidence(steps={**done(0), 1: StepRecord(1, StepState.STARTED)}),
                 13, "resume", "resumed_idempotent_step", 1, id="13-resumed_idempotent_step"),
    pytest.param(evidence(steps=done(0, 1)),
                 14, "resume", "resumed_from_unstarted_step", 2,
                 id="14-resumed_from_unstarted_step"),
]


class TestEachRuleIsReached:
    """Evidence built for one row gets that row's decision."""

    @pytest.mark.parametrize(("ev", "number", "disposition", "reason", "resume_at"),
                             REACH_CASES)
    def test_rule_decides_its_evidence(self, ev: Evidence, number: int, disposition: str,
                                       reason: str, resume_at: int | None) -> None:
        """Evidence matching a row yields its rule number, disposition, reason and resume step."""
        got = decide(ev, THRESHOLDS)
        assert got == Decision(7, Disposition(disposition), Reason(reason), resume_at, number)

    def test_every_rule_has_a_reach_case(self) -> None:
        """The reach cases above cover every rule."""
        assert sorted(cast(int, p.values[1]) for p in REACH_CASES) == list(RULE_NUMBERS)

    def test_resume_starts_at_the_first_step_when_nothing_ran(self) -> None:
        """A job that died before any step resumes at step 0."""
        got = decide(evidence(), THRESHOLDS)
        assert (got.reason, got.resume_step_index) == (Reason.RESUMED_FROM_UNSTARTED_STEP, 0)

    def test_retryable_failure_resumes_at_the_failed_step(self) -> None:
        """A step that failed retryably is run again: resume at it."""
        got = decide(evidence(steps={0: StepRecord(0, StepState.FAILED, True)}), THRESHOLDS)
        assert (got.disposition, got.reason, got.resume_step_index) == (
            Disposition.RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP, 0)

    def test_interrupted_pure_step_resumes_at_it(self) -> None:
        """A started pure step is safe to repeat: resume at it."""
        got = decide(evidence(steps={**done(0), 1: StepRecord(1, StepState.STARTED)}),
                     THRESHOLDS)
        assert PLAN3[1].effect_kind is EffectKind.PURE
        assert (got.reason, got.resume_step_index) == (Reason.RESUMED_IDEMPOTENT_STEP, 1)

    def test_gone_session_makes_a_live_lease_count_as_expired(self) -> None:
        """A claim whose worker session is gone is judged at once, not skipped as lease_live."""
        got = decide(evidence(lease_live=True, session_gone=True), THRESHOLDS)
        assert got.reason is Reason.RESUMED_FROM_UNSTARTED_STEP

    def test_gone_session_does_not_wait_for_activity_to_go_stale(self) -> None:
        """A claim whose worker session is gone is recovered at once, even with recent activity."""
        got = decide(evidence(session_gone=True, age=1.0), THRESHOLDS)
        assert got.reason is Reason.RESUMED_FROM_UNSTARTED_STEP

    def test_gone_session_is_not_wedged(self) -> None:
        """A gone session under a live lease with old activity is recovered, not wedged."""
        got = decide(evidence(lease_live=True, session_gone=True, age=WEDGED * 2), THRESHOLDS)
        assert got.reason is Reason.RESUMED_FROM_UNSTARTED_STEP

    def test_wedged_threshold_is_inclusive(self) -> None:
        """Exactly wedged_after_seconds of silence under a live lease is a hang."""
        at = decide(evidence(lease_live=True, age=WEDGED), THRESHOLDS)
        below = decide(evidence(lease_live=True, age=WEDGED - 0.001), THRESHOLDS)
        assert (at.reason, below.reason) == (Reason.WORKER_WEDGED, Reason.LEASE_LIVE)

    def test_stale_threshold_is_exclusive(self) -> None:
        """Activity exactly stale_after_seconds old no longer protects an expired lease."""
        at = decide(evidence(age=STALE), THRESHOLDS)
        below = decide(evidence(age=STALE - 0.001), THRESHOLDS)
        assert (at.reason, below.reason) == (
            Reason.RESUMED_FROM_UNSTARTED_STEP, Reason.RECENT_ACTIVITY)

    def test_unknown_activity_age_is_neither_recent_nor_wedged(self) -> None:
        """With no recorded activity a live lease is skipped and an expired one is judged."""
        live = decide(evidence(lease_live=True, age=None), THRESHOLDS)
        expired = decide(evidence(age=None), THRESHOLDS)
        assert (live.reason, expired.reason) == (
            Reason.LEASE_LIVE, Reason.RESUMED_FROM_UNSTARTED_STEP)

    def test_decision_carries_the_job_id(self) -> None:
        """The decision names the job its evidence was about."""
        ev = dataclasses.replace(evidence(), job_id=123_456)
        assert decide(ev, THRESHOLDS).job_id == 123_456

    def test_thresholds_come_from_the_caller(self) -> None:
        """The same age is recent or stale depending on the thresholds passed in."""
        ev = evidence(age=100.0)
        assert decide(ev, Thresholds(200.0, 400.0)).reason is Reason.RECENT_ACTIVITY
        assert decide(ev, Thresholds(50.0, 400.0)).reason is Reason.RESUMED_FROM_UNSTARTED_STEP


def _crash_loop_after(n: int | None) -> Thresholds:
    return dataclasses.replace(THRESHOLDS, crash_loop_after=n)


class TestCrashLoop:
    """A job whose last crash_loop_after attempts were all lost ends crash_loop, not resumed."""

    def test_second_lost_attempt_in_a_row_ends_crash_loop(self) -> None:
        """With the default of 2, the first crash resumes and the second ends the job."""
        first = decide(evidence(lost=1), THRESHOLDS)
        second = decide(evidence(lost=2, attempts=2), THRESHOLDS)
        assert (first.disposition, first.reason) == (
            Disposition.RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP)
        assert (second.disposition, second.reason, second.resume_step_index) == (
            Disposition.TERMINALIZE, Reason.CRASH_LOOP, None)
        assert second.status_after is JobStatus.FAILED

    @pytest.mark.parametrize(("after", "lost", "crash_loop"), [
        (1, 0, False), (1, 1, True), (3, 2, False), (3, 3, True), (3, 7, True)])
    def test_threshold_is_inclusive(self, after: int, lost: int, crash_loop: bool) -> None:
        """lost_attempts_in_a_row >= crash_loop_after is a crash loop; one fewer is not."""
        got = decide(evidence(lost=lost, max_attempts=10), _crash_loop_after(after))
        assert (got.reason is Reason.CRASH_LOOP) is crash_loop

    def test_no_threshold_turns_the_rule_off(self) -> None:
        """Thresholds without crash_loop_after (a caller that does not pass it) never match."""
        got = decide(evidence(lost=50, max_attempts=100), Thresholds(STALE, WEDGED))
        assert got.reason is Reason.RESUMED_FROM_UNSTARTED_STEP

    def test_a_source_without_attempts_never_crash_loops(self) -> None:
        """Evidence left at lost_attempts_in_a_row 0 never matches, even with a threshold of 1."""
        ev = Evidence(job_id=1, attempt_count=1, max_attempts=3,
                      operator_hold=False, lease_live=False, lease_expired_seconds=5.0,
                      activity_age_seconds=600.0, plan=PLAN3)
        assert ev.lost_attempts_in_a_row == 0
        assert decide(ev, _crash_loop_after(1)).reason is Reason.RESUMED_FROM_UNSTARTED_STEP

    @pytest.mark.parametrize(("ev", "reason"), [
        pytest.param(evidence(lost=9, hold=True), Reason.OPERATOR_HOLD, id="held"),
        pytest.param(evidence(lost=9, lease_live=True), Reason.LEASE_LIVE, id="lease-live"),
        pytest.param(evidence(lost=9, age=1.0), Reason.RECENT_ACTIVITY, id="recent"),
        pytest.param(evidence(lost=9, plan=None), Reason.UNRESUMABLE_PLAN, id="no-plan"),
        pytest.param(evidence(lost=9, steps={0: StepRecord(0, StepState.WAITING)}),
                     Reason.WAITING_ON_GATE, id="gated"),
        pytest.param(evidence(lost=9, steps=done(0, 1, 2), recoverable=True),
                     Reason.COMPLETION_RECOVERED, id="recoverable"),
        pytest.param(evidence(lost=9, steps=done(0, 1, 2)),
                     Reason.COMPLETION_UNRECORDED, id="all-done"),
        pytest.param(evidence(lost=9, steps={0: StepRecord(0, StepState.FAILED, False)}),
                     Reason.STEP_FAILED, id="failed-for-good"),
        pytest.param(evidence(lost=9, steps={**done(0, 1), 2: StepRecord(2, StepState.STARTED)}),
                     Reason.WORKER_DIED_MID_STEP, id="effect-in-doubt"),
    ])
    def test_rules_that_say_more_come_first(self, ev: Evidence, reason: Reason) -> None:
        """A crash-looping job that is live, held, gated, done, failed or mid-effect gets
        that reason: it says more, and for an effect in doubt it is the safe one."""
        assert decide(ev, THRESHOLDS).reason is reason

    @pytest.mark.parametrize("ev", [
        pytest.param(evidence(lost=3, attempts=3, max_attempts=3), id="unstarted"),
        pytest.param(evidence(lost=3, attempts=3, max_attempts=3,
                              steps={0: StepRecord(0, StepState.STARTED)}), id="idempotent"),
        pytest.param(evidence(lost=3, attempts=3, max_attempts=3,
                              steps={0: StepRecord(0, StepState.FAILED, True)}), id="retryable"),
    ])
    def test_crash_loop_wins_over_the_spent_budget_and_the_resumes(self, ev: Evidence) -> None:
        """A crash loop with its budget spent is named for its cause, not the budget."""
        assert decide(ev, THRESHOLDS).reason is Reason.CRASH_LOOP
        assert decide(ev, Thresholds(STALE, WEDGED)).reason is Reason.RESUME_EXHAUSTED

    def test_crash_loop_ends_the_job_before_the_budget_does(self) -> None:
        """With 25 attempts allowed, the second lost attempt in a row still ends the job."""
        got = decide(evidence(lost=2, attempts=2, max_attempts=25,
                              steps={0: StepRecord(0, StepState.STARTED)}), THRESHOLDS)
        assert got.reason is Reason.CRASH_LOOP


class TestCompletionRecovered:
    """Finished work the source can record is completed, not failed."""

    def test_recoverable_completion_ends_completed(self) -> None:
        """Every step succeeded and the source can record completion: terminalize, completed."""
        got = decide(evidence(steps=done(0, 1, 2), recoverable=True), THRESHOLDS)
        assert (got.disposition, got.reason, got.resume_step_index) == (
            Disposition.TERMINALIZE, Reason.COMPLETION_RECOVERED, None)
        assert got.status_after is JobStatus.COMPLETED

    def test_other_sources_keep_completion_unrecorded(self) -> None:
        """Without the source's flag the same evidence ends failed completion_unrecorded."""
        got = decide(evidence(steps=done(0, 1, 2)), THRESHOLDS)
        assert (got.reason, got.status_after) == (Reason.COMPLETION_UNRECORDED, JobStatus.FAILED)

    @pytest.mark.parametrize(("steps", "reason"), [
        pytest.param(done(0, 1), Reason.RESUMED_FROM_UNSTARTED_STEP, id="last-not-started"),
        pytest.param({**done(0, 1), 2: StepRecord(2, StepState.STARTED)},
                     Reason.WORKER_DIED_MID_STEP, id="last-mid-effect"),
        pytest.param({**done(0, 1), 2: StepRecord(2, StepState.WAITING)},
                     Reason.WAITING_ON_GATE, id="last-gated"),
    ])
    def test_the_flag_alone_recovers_nothing(self, steps: dict[int, StepRecord],
                                             reason: Reason) -> None:
        """A source flag with a step unfinished is ignored: the steps decide."""
        assert decide(evidence(steps=steps, recoverable=True), THRESHOLDS).reason is reason

    def test_a_held_or_live_job_is_not_completed(self) -> None:
        """The earlier rules still protect a held job and a live worker."""
        held = decide(evidence(steps=done(0, 1, 2), recoverable=True, hold=True), THRESHOLDS)
        live = decide(evidence(steps=done(0, 1, 2), recoverable=True, lease_live=True),
                      THRESHOLDS)
        assert (held.reason, live.reason) == (Reason.OPERATOR_HOLD, Reason.LEASE_LIVE)


class TestStatusAfter:
    """What status each decision gives the job."""

    @pytest.mark.parametrize("rule", RULES, ids=lambda r: r.reason.value)
    def test_every_rule_has_its_status(self, rule: Rule) -> None:
        """Resumes queue, completion_recovered completes, other terminalizations fail,
        skips change nothing."""
        want = {Disposition.RESUME: JobStatus.QUEUED, Disposition.SKIP: None,
                Disposition.TERMINALIZE: JobStatus.FAILED}[rule.disposition]
        if rule.reason is Reason.COMPLETION_RECOVERED:
            want = JobStatus.COMPLETED
        assert status_after(rule.disposition, rule.reason) is want

    def test_pass_outcomes_change_nothing(self) -> None:
        """fence_lost, reconcile_error and mass_staleness_brake are skips: no new status."""
        for reason in (Reason.FENCE_LOST, Reason.RECONCILE_ERROR, Reason.MASS_STALENESS_BRAKE):
            assert Decision(1, Disposition.SKIP, reason).status_after is None

    def test_a_decision_answers_as_the_function_for_every_pair(self) -> None:
        """``Decision.status_after`` (a lookup made from ``status_after``) agrees with it on
        every disposition and reason, rules and pass outcomes alike."""
        for disposition in Disposition:
            for reason in Reason:
                assert (Decision(1, disposition, reason).status_after
                        is status_after(disposition, reason))


# --------------------------------------------------------------------------------------
# Order and exhaustive agreement with the design.
# --------------------------------------------------------------------------------------


class TestOrder:
    """The first matching row decides, in the order the table gives."""

    def test_grid_covers_many_feature_combinations(self) -> None:
        """The feature grid is the full product of the features the table reads."""
        assert len(grid()) == (2 * 2 * 2 * len(AGES) * len(tuple(_plan_variants()))
                               * len(ATTEMPTS) * len(LOST))

    def test_decide_agrees_with_design_on_every_grid_point(self) -> None:
        """For every combination of features, decide() equals the table read plainly."""
        assert disagreements() == []

    def test_every_rule_is_reached_on_the_grid(self) -> None:
        """Each rule decides at least one grid point."""
        reached = {decide(ev, THRESHOLDS).rule_number for _, ev in grid()}
        assert reached == set(RULE_NUMBERS)

    @pytest.mark.parametrize(("i", "j"), list(itertools.combinations(RULE_NUMBERS, 2)),
                             ids=str)
    def test_earlier_rule_wins_over_later(self, i: int, j: int) -> None:
        """When rows i<j both match (and nothing earlier), rule i decides."""
        witnesses = pair_witnesses()[(i, j)]
        if (i, j) in CANNOT_CO_OCCUR:
            assert witnesses == (), f"rows {i} and {j} were documented as exclusive"
            return
        assert witnesses, f"no grid evidence matches rows {i} and {j}; document why"
        assert {decide(ev, THRESHOLDS).rule_number for ev in witnesses} == {i}

    def test_documented_exclusive_pairs_are_ordered(self) -> None:
        """Every documented exclusive pair is a real pair i<j of rule numbers."""
        assert all(1 <= i < j <= RULE_COUNT for i, j in CANNOT_CO_OCCUR)

    def test_crash_loop_sits_after_the_rules_that_say_more_and_before_the_resumes(
            self) -> None:
        """crash_loop comes after rules 1-10 and before resume_exhausted and both resumes."""
        order = [r.reason for r in RULES]
        crash = order.index(Reason.CRASH_LOOP)
        assert order[crash - 1] is Reason.WORKER_DIED_MID_STEP
        assert order[crash + 1:] == [Reason.RESUME_EXHAUSTED, Reason.RESUMED_IDEMPOTENT_STEP,
                                     Reason.RESUMED_FROM_UNSTARTED_STEP]

    def test_completion_recovered_comes_right_before_completion_unrecorded(self) -> None:
        """The recovered variant is tried first, so the source finishes what it can."""
        order = [r.reason for r in RULES]
        assert order.index(Reason.COMPLETION_RECOVERED) + 1 == order.index(
            Reason.COMPLETION_UNRECORDED)


class TestOracleCatchesMutations:
    """A broken table is caught: the tests above are not tautologies."""

    def test_reordered_table_is_caught_by_the_oracle(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Swapping worker_died_mid_step and resume_exhausted makes decide() disagree."""
        _table_with(_swapped(10, 12), monkeypatch)
        assert disagreements(limit=1)

    def test_lease_live_ignoring_gone_sessions_is_caught(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Dropping 'session not gone' from rule 3 makes decide() disagree with the design."""
        _table_with(_replaced(3, lambda ev, _t: ev.lease_live), monkeypatch)
        assert disagreements(limit=1)

    def test_wedged_ignoring_gone_sessions_is_caught(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Dropping 'session not gone' from rule 2 makes decide() disagree with the design."""
        def wedged(ev: Evidence, t: Thresholds) -> bool:
            age = ev.activity_age_seconds
            return ev.lease_live and age is not None and age >= t.wedged_after_seconds

        _table_with(_replaced(2, wedged), monkeypatch)
        assert disagreements(limit=1)

    def test_recent_activity_ignoring_gone_sessions_is_caught(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Letting recent activity protect a gone session's claim makes decide() disagree."""
        def recent(ev: Evidence, t: Thresholds) -> bool:
            age = ev.activity_age_seconds
            return age is not None and age < t.stale_after_seconds

        _table_with(_replaced(4, recent), monkeypatch)
        assert disagreements(limit=1)

    def test_off_by_one_stale_boundary_is_caught(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Treating age == stale_after_seconds as recent makes decide() disagree."""
        def recent(ev: Evidence, t: Thresholds) -> bool:
            age = ev.activity_age_seconds
            return not ev.session_gone and age is not None and age <= t.stale_after_seconds

        _table_with(_replaced(4, recent), monkeypatch)
        assert disagreements(limit=1)

    def test_retryable_failure_treated_as_permanent_is_caught(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Terminalizing every failed step (retryable or not) makes decide() disagree."""
        def any_failure(ev: Evidence, _t: Thresholds) -> bool:
            record = ev.first_unfinished
            return record is not None and record.step_state is StepState.FAILED

        _table_with(_replaced(9, any_failure), monkeypatch)
        assert disagreements(limit=1)

    def test_off_by_one_crash_loop_threshold_is_caught(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Requiring more lost attempts than crash_loop_after makes decide() disagree."""
        def crash_loop(ev: Evidence, t: Thresholds) -> bool:
            after = t.crash_loop_after
            return after is not None and ev.lost_attempts_in_a_row > after

        _table_with(_replaced(11, crash_loop), monkeypatch)
        assert disagreements(limit=1)

    def test_recovering_without_the_source_flag_is_caught(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Completing every all-succeeded job, flag or not, makes decide() disagree."""
        _table_with(_replaced(7, lambda ev, _t: ev.first_unfinished_index is None), monkeypatch)
        assert disagreements(limit=1)

    def test_recovering_on_the_flag_alone_is_caught(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Trusting the flag without checking every step succeeded makes decide() disagree."""
        _table_with(_replaced(7, lambda ev, _t: ev.plan is not None and ev.completion_recoverable),
                    monkeypatch)
        assert disagreements(limit=1)

    @pytest.mark.parametrize(
        ("i", "j"),
        [p for p in itertools.combinations(RULE_NUMBERS, 2) if p not in CANNOT_CO_OCCUR],
        ids=str,
    )
    def test_swapping_any_observable_pair_is_caught(
        self, i: int, j: int, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Swapping two rules whose evidence can co-occur changes a decision on their witnesses."""
        _table_with(_swapped(i, j), monkeypatch)
        witnesses = pair_witnesses()[(i, j)]
        assert any(
            (decide(ev, THRESHOLDS).reason.value, decide(ev, THRESHOLDS).resume_step_index)
            != design_table(ev, STALE, WEDGED)
            for ev in witnesses
        )


# --------------------------------------------------------------------------------------
# Property: arbitrary evidence.
# --------------------------------------------------------------------------------------

AGE_VALUES = st.one_of(
    st.none(),
    st.sampled_from([0.0, STALE, WEDGED, -1.0]),
    st.floats(allow_nan=True, allow_infinity=True),
)


@st.composite
def thresholds(draw: st.DrawFn) -> Thresholds:
    """Thresholds as Settings allows them: 0 <= stale < wedged."""
    use_default = draw(st.booleans())
    if use_default:
        return THRESHOLDS
    stale = draw(st.floats(min_value=0, max_value=1e6))
    wedged = stale + draw(st.floats(min_value=1e-3, max_value=1e6))
    crash_loop_after = draw(st.one_of(st.none(), st.integers(min_value=1, max_value=6)))
    return Thresholds(stale, wedged, crash_loop_after)


@st.composite
def arbitrary_evidence(draw: st.DrawFn) -> Evidence:
    """Any Evidence, including contradictory records, odd ages and odd attempt counts."""
    plan = draw(st.one_of(st.none(), st.lists(
        st.builds(PlanStep, st.sampled_from(["a", "b", "c"]), st.sampled_from(list(EffectKind))),
        min_size=1, max_size=5,
    ).map(tuple)))
    rows = draw(st.dictionaries(
        st.integers(min_value=0, max_value=6),
        st.tuples(st.sampled_from(list(StepState)), st.one_of(st.none(), st.booleans())),
        max_size=7,
    ))
    steps = {i: StepRecord(i, state, retryable) for i, (state, retryable) in rows.items()}
    if plan is not None:  # often make a prefix succeed so the later rows are reached
        for i in range(draw(st.integers(min_value=0, max_value=len(plan)))):
            steps[i] = StepRecord(i, StepState.SUCCEEDED)
    return Evidence(
        job_id=draw(st.integers(min_value=1, max_value=2**53)),
        attempt_count=draw(st.integers(min_value=0, max_value=10)),
        max_attempts=draw(st.integers(min_value=0, max_value=10)),
        operator_hold=draw(st.booleans()),
        lease_live=draw(st.booleans()),
        lease_expired_seconds=draw(AGE_VALUES),
        activity_age_seconds=draw(AGE_VALUES),
        plan=plan,
        steps=steps,
        session_gone=draw(st.booleans()),
        lost_attempts_in_a_row=draw(st.integers(min_value=0, max_value=8)),
        completion_recoverable=draw(st.booleans()),
    )


class TestArbitraryEvidence:
    """decide() is total over every Evidence value."""

    @settings(max_examples=300, deadline=None)
    @given(arbitrary_evidence(), thresholds())
    def test_decide_never_raises_and_returns_a_rule_reason(
        self, ev: Evidence, limits: Thresholds
    ) -> None:
        """Any evidence gets one of the rules' decisions: the one the design's table gives."""
        got = decide(ev, limits)
        assert got.reason.value in RULE_REASONS
        assert got.job_id == ev.job_id
        assert got.rule_number is not None
        rule = RULES[got.rule_number - 1]
        assert (rule.reason, rule.disposition) == (got.reason, got.disposition)
        if got.disposition is Disposition.RESUME:
            assert ev.plan is not None
            assert got.resume_step_index is not None
            assert 0 <= got.resume_step_index < len(ev.plan)
            record = ev.steps.get(got.resume_step_index)
            assert record is None or record.step_state is not StepState.SUCCEEDED
        else:
            assert got.resume_step_index is None
        want = design_table(ev, limits.stale_after_seconds, limits.wedged_after_seconds,
                            limits.crash_loop_after)
        assert (got.reason.value, got.resume_step_index) == want


# --------------------------------------------------------------------------------------
# The table as data, and its printed forms.
# --------------------------------------------------------------------------------------


class TestTableAsData:
    """RULES is the one table; its numbers, reasons and texts match the transcription."""

    def test_rule_numbers_run_from_one_in_order(self) -> None:
        """Rules are numbered 1..14 in the order they are tried."""
        assert [r.number for r in RULES] == list(RULE_NUMBERS)

    def test_reasons_are_unique(self) -> None:
        """No two rules share a reason, so a reason names exactly one rule."""
        assert len({r.reason for r in RULES}) == len(RULES)

    def test_rows_match_design(self) -> None:
        """Number, disposition and reason of every row are those of the transcription."""
        assert [(r.number, r.disposition.value, r.reason.value) for r in RULES] == [
            (n, d, reason) for n, _, d, reason in DESIGN_TABLE
        ]

    def test_evidence_texts_match_design(self) -> None:
        """Each rule's evidence text is the transcription's (no backticks), maybe clarified."""
        for rule, (_, design_text, _, _) in zip(RULES, DESIGN_TABLE, strict=True):
            plain = design_text.replace("`", "")
            assert rule.evidence == plain or rule.evidence.startswith(plain + " ("), rule.number

    def test_every_reason_is_a_rule_or_a_pass_outcome(self) -> None:
        """Reason holds the rules' reasons plus the pass's own three outcomes, no more."""
        assert {r.value for r in Reason} == RULE_REASONS | PASS_OUTCOME_REASONS

    def test_every_rule_has_a_description(self) -> None:
        """Every rule says why in one non-empty line."""
        assert all(r.description.strip() and "\n" not in r.description for r in RULES)

    def test_rules_are_immutable(self) -> None:
        """A rule cannot be changed in place."""
        with pytest.raises(dataclasses.FrozenInstanceError):
            RULES[0].number = 99  # type: ignore[misc]


class TestRenderedTable:
    """`reconciler explain` and the generated docs print the same rules."""

    def test_text_table_mentions_every_rule(self) -> None:
        """The text table shows every rule's number, reason, evidence and description."""
        text = decisions.render_table()
        for rule in RULES:
            assert rule.reason.value in text
            assert rule.evidence in text
            assert rule.description in text
            assert rule.disposition.value in text

    def test_text_table_lists_rules_in_order(self) -> None:
        """Reasons appear in the text table in rule order."""
        text = decisions.render_table()
        positions = [text.index(f"  {r.reason.value} ") for r in RULES]
        assert positions == sorted(positions)

    def test_text_table_explains_pass_outcomes(self) -> None:
        """The text table also names the pass's own outcomes and shadow mode."""
        text = decisions.render_table()
        assert all(reason in text for reason in PASS_OUTCOME_REASONS)
        assert "shadow" in text

    def test_markdown_has_one_row_per_rule_in_order(self) -> None:
        """The Markdown table has one row per rule, in order, with all five columns."""
        lines = decisions.render_markdown().splitlines()
        header = lines.index("| # | evidence | disposition | reason | why |")
        rows = lines[header + 2:header + 2 + len(RULES)]
        for line, rule in zip(rows, RULES, strict=True):
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert cells == [str(rule.number), rule.evidence, rule.disposition.value,
                             f"`{rule.reason.value}`", rule.description]
        after = lines[header + 2 + len(RULES):]
        assert not any(line.startswith("|") for line in after)

    def test_markdown_mentions_every_reason_and_description(self) -> None:
        """The Markdown mentions every rule's reason and description, and the pass outcomes."""
        text = decisions.render_markdown()
        assert all(r.reason.value in text and r.description in text for r in RULES)
        assert all(f"`{reason}`" in text for reason in PASS_OUTCOME_REASONS)

    def test_markdown_says_why_the_new_rules_sit_where_they_do(self) -> None:
        """The docs carry the order notes of completion_recovered and crash_loop."""
        text = decisions.render_markdown()
        for reason, why in decisions.ORDER_NOTES:
            assert f"- `{reason.value}`: {why}" in text
        assert {reason.value for reason, _ in decisions.ORDER_NOTES} == SECTION_11_REASONS

    def test_generated_docs_are_current(self) -> None:
        """docs/decision-table.md is exactly what render_markdown() prints."""
        docs = (REPO_ROOT / "docs" / "decision-table.md").read_text(encoding="utf-8")
        assert docs == decisions.render_markdown()
