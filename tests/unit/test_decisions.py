"""The decision table (DESIGN.md section 5): evidence in, one decision out, first rule wins.

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
from reconciler.core.decisions import RULES, Decision, Rule, Thresholds, decide
from reconciler.core.evidence import Evidence, PlanStep, StepRecord
from reconciler.core.vocabulary import Disposition, EffectKind, Reason, StepState

REPO_ROOT = Path(__file__).resolve().parents[2]

STALE = 60.0
WEDGED = 3600.0
THRESHOLDS = Thresholds(stale_after_seconds=STALE, wedged_after_seconds=WEDGED)

# DESIGN.md section 5, transcribed by hand: (number, evidence, disposition, reason).
DESIGN_TABLE: tuple[tuple[int, str, str, str], ...] = (
    (1, "operator hold set", "skip", "operator_hold"),
    (2, "lease live, but no activity for `wedged_after_seconds`", "terminalize",
     "worker_wedged"),
    (3, "lease live (and its worker session not gone)", "skip", "lease_live"),
    (4, "activity newer than `stale_after_seconds`", "skip", "recent_activity"),
    (5, "step plan missing or unreadable", "terminalize", "unresumable_plan"),
    (6, "first unfinished step is `waiting`", "skip", "waiting_on_gate"),
    (7, "every step succeeded, completion not recorded", "terminalize",
     "completion_unrecorded"),
    (8, "first unfinished step failed, not retryable", "terminalize", "step_failed"),
    (9, "first unfinished step started, `effectful`", "terminalize", "worker_died_mid_step"),
    (10, "attempts used >= max attempts", "terminalize", "resume_exhausted"),
    (11, "first unfinished step started, `pure`/`idempotent`", "resume",
     "resumed_idempotent_step"),
    (12, "otherwise (first unfinished step never started)", "resume",
     "resumed_from_unstarted_step"),
)
RULE_REASONS = frozenset(reason for _, _, _, reason in DESIGN_TABLE)
PASS_OUTCOME_REASONS = frozenset({"fence_lost", "reconcile_error"})


# --------------------------------------------------------------------------------------
# The oracle: DESIGN.md section 5 written out plainly.
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


def design_table(ev: Evidence, stale: float, wedged: float) -> tuple[str, int | None]:
    """The reason and resume step DESIGN.md section 5 gives for this evidence.

    Interpretations the table leaves implicit, written down here:
    - a claim whose worker session is gone is "treated as expired at once" (section 3a): its
      lease does not count as live (rules 2 and 3) and its recent activity does not make the
      reconciler wait (rule 4) - the worker is known to be dead;
    - "no activity for wedged_after_seconds" means an age >= the threshold; an unknown age
      (no activity recorded) is neither wedged nor recent;
    - a failed step counts as retryable only when recorded as retryable (unknown = not).
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
    elif first is None:
        return "completion_unrecorded", None
    elif state == "failed" and record is not None and record.failure_retryable is not True:
        return "step_failed", None
    elif state == "started" and effect == "effectful":
        return "worker_died_mid_step", None
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
    7: lambda ev: ev.plan is not None and not _has_unfinished(ev),
    8: _failed_for_good,
    9: lambda ev: _first_state(ev) == "started" and _first_effect(ev) == "effectful",
    10: lambda ev: ev.attempt_count >= ev.max_attempts,
    11: lambda ev: _first_state(ev) == "started" and _first_effect(ev) in ("pure", "idempotent"),
    12: lambda ev: True,  # "otherwise"
}

# Pairs of rows whose evidence cannot hold at once, and why. Their relative order cannot
# be observed; the pairwise test checks that this list is exactly right.
CANNOT_CO_OCCUR: dict[tuple[int, int], str] = {
    (2, 4): "an age >= wedged_after_seconds is never < stale_after_seconds (stale < wedged)",
    (5, 6): "without a plan there is no first unfinished step",
    (5, 7): "without a plan there is no first unfinished step",
    (5, 8): "without a plan there is no first unfinished step",
    (5, 9): "without a plan there is no first unfinished step",
    (5, 11): "without a plan there is no first unfinished step",
    (6, 7): "a waiting step is an unfinished step",
    (6, 8): "the first unfinished step has one state",
    (6, 9): "the first unfinished step has one state",
    (6, 11): "the first unfinished step has one state",
    (7, 8): "when every step succeeded there is no failed step",
    (7, 9): "when every step succeeded there is no started step",
    (7, 11): "when every step succeeded there is no started step",
    (8, 9): "the first unfinished step has one state",
    (8, 11): "the first unfinished step has one state",
    (9, 11): "a step is effectful or pure/idempotent, never both",
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
) -> Evidence:
    """Evidence of an expired, stale, resumable job unless told otherwise."""
    return Evidence(
        job_id=7, attempt_count=attempts, max_attempts=max_attempts,
        operator_hold=hold, lease_live=lease_live,
        lease_expired_seconds=None if lease_live else 120.0,
        activity_age_seconds=age, plan=plan, steps=dict(steps or {}), session_gone=session_gone,
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


def _plan_variants() -> Iterator[tuple[str, tuple[PlanStep, ...] | None, dict[int, StepRecord]]]:
    yield "no-plan", None, {}
    yield "all-succeeded", PLAN3, done(0, 1, 2)
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
        yield label, plan, steps


@cache
def grid() -> tuple[tuple[str, Evidence], ...]:
    """Every combination of the features the table reads."""
    points = []
    for hold, live, gone, age, (label, plan, steps), (used, most) in itertools.product(
        (False, True), (False, True), (False, True), AGES, tuple(_plan_variants()), ATTEMPTS
    ):
        ev = evidence(hold=hold, lease_live=live, session_gone=gone, age=age, plan=plan,
                      steps=steps, attempts=used, max_attempts=most)
        points.append((f"hold={hold} live={live} gone={gone} age={age} {label} "
                       f"attempts={used}/{most}", ev))
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
        pair: [] for pair in itertools.combinations(range(1, 13), 2)
    }
    for _, ev in grid():
        matched = [n for n in range(1, 13) if ROW_CONDITIONS[n](ev)]
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
    pytest.param(evidence(steps=done(0, 1, 2)),
                 7, "terminalize", "completion_unrecorded", None, id="7-completion_unrecorded"),
    pytest.param(evidence(steps={**done(0), 1: StepRecord(1, StepState.FAILED, False)}),
                 8, "terminalize", "step_failed", None, id="8-step_failed"),
    pytest.param(evidence(steps={**done(0, 1), 2: StepRecord(2, StepState.STARTED)}),
                 9, "terminalize", "worker_died_mid_step", None, id="9-worker_died_mid_step"),
    pytest.param(evidence(steps=done(0), attempts=3, max_attempts=3),
                 10, "terminalize", "resume_exhausted", None, id="10-resume_exhausted"),
    pytest.param(evidence(steps={**done(0), 1: StepRecord(1, StepState.STARTED)}),
                 11, "resume", "resumed_idempotent_step", 1, id="11-resumed_idempotent_step"),
    pytest.param(evidence(steps=done(0, 1)),
                 12, "resume", "resumed_from_unstarted_step", 2,
                 id="12-resumed_from_unstarted_step"),
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
        """The reach cases above cover all twelve rules."""
        assert sorted(cast(int, p.values[1]) for p in REACH_CASES) == list(range(1, 13))

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


# --------------------------------------------------------------------------------------
# Order and exhaustive agreement with the design.
# --------------------------------------------------------------------------------------


class TestOrder:
    """The first matching row decides, in the order DESIGN.md gives."""

    def test_grid_covers_many_feature_combinations(self) -> None:
        """The feature grid is the full product of the features the table reads."""
        assert len(grid()) == 2 * 2 * 2 * len(AGES) * len(tuple(_plan_variants())) * len(ATTEMPTS)

    def test_decide_agrees_with_design_on_every_grid_point(self) -> None:
        """For every combination of features, decide() equals the DESIGN.md table read plainly."""
        assert disagreements() == []

    def test_every_rule_is_reached_on_the_grid(self) -> None:
        """Each of the twelve rules decides at least one grid point."""
        reached = {decide(ev, THRESHOLDS).rule_number for _, ev in grid()}
        assert reached == set(range(1, 13))

    @pytest.mark.parametrize(("i", "j"), list(itertools.combinations(range(1, 13), 2)),
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
        assert all(1 <= i < j <= 12 for i, j in CANNOT_CO_OCCUR)


class TestOracleCatchesMutations:
    """A broken table is caught: the tests above are not tautologies."""

    def test_reordered_table_is_caught_by_the_oracle(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Swapping rules 9 and 10 makes decide() disagree with the design."""
        _table_with(_swapped(9, 10), monkeypatch)
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

        _table_with(_replaced(8, any_failure), monkeypatch)
        assert disagreements(limit=1)

    @pytest.mark.parametrize(
        ("i", "j"),
        [p for p in itertools.combinations(range(1, 13), 2) if p not in CANNOT_CO_OCCUR],
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
    return Thresholds(stale, wedged)


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
    )


class TestArbitraryEvidence:
    """decide() is total over every Evidence value."""

    @settings(max_examples=300, deadline=None)
    @given(arbitrary_evidence(), thresholds())
    def test_decide_never_raises_and_returns_a_rule_reason(
        self, ev: Evidence, limits: Thresholds
    ) -> None:
        """Any evidence gets one of the twelve rules' decisions: the one DESIGN.md's table gives."""
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
        want = design_table(ev, limits.stale_after_seconds, limits.wedged_after_seconds)
        assert (got.reason.value, got.resume_step_index) == want


# --------------------------------------------------------------------------------------
# The table as data, and its printed forms.
# --------------------------------------------------------------------------------------


class TestTableAsData:
    """RULES is the one table; its numbers, reasons and texts match DESIGN.md."""

    def test_rule_numbers_run_one_to_twelve_in_order(self) -> None:
        """Rules are numbered 1..12 in the order they are tried."""
        assert [r.number for r in RULES] == list(range(1, 13))

    def test_reasons_are_unique(self) -> None:
        """No two rules share a reason, so a reason names exactly one rule."""
        assert len({r.reason for r in RULES}) == len(RULES)

    def test_transcription_matches_design_document(self) -> None:
        """DESIGN_TABLE above is a faithful copy of DESIGN.md section 5 (when the file is here)."""
        design = REPO_ROOT.parent / "shared" / "DESIGN.md"
        if not design.is_file():
            pytest.skip("DESIGN.md is not beside this checkout")
        text = design.read_text(encoding="utf-8")
        section = text[text.index("## 5."):text.index("## 6.")]
        rows = []
        for line in section.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 4 and cells[0].isdigit():
                rows.append((int(cells[0]), cells[1], cells[2].split()[0], cells[3].strip("`")))
        assert tuple(rows) == DESIGN_TABLE

    def test_rows_match_design(self) -> None:
        """Number, disposition and reason of every row are those of DESIGN.md section 5."""
        assert [(r.number, r.disposition.value, r.reason.value) for r in RULES] == [
            (n, d, reason) for n, _, d, reason in DESIGN_TABLE
        ]

    def test_evidence_texts_match_design(self) -> None:
        """Each rule's evidence text is DESIGN.md's (no backticks), at most with a clarification."""
        for rule, (_, design_text, _, _) in zip(RULES, DESIGN_TABLE, strict=True):
            plain = design_text.replace("`", "")
            assert rule.evidence == plain or rule.evidence.startswith(plain + " ("), rule.number

    def test_every_reason_is_a_rule_or_a_pass_outcome(self) -> None:
        """Reason holds the twelve rule reasons plus fence_lost and reconcile_error, no more."""
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
        """The text table also names fence_lost and reconcile_error."""
        text = decisions.render_table()
        assert "fence_lost" in text
        assert "reconcile_error" in text

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
        assert "`fence_lost`" in text
        assert "`reconcile_error`" in text

    def test_generated_docs_are_current(self) -> None:
        """docs/decision-table.md is exactly what render_markdown() prints."""
        docs = (REPO_ROOT / "docs" / "decision-table.md").read_text(encoding="utf-8")
        assert docs == decisions.render_markdown()
