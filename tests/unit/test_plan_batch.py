"""A batch is planned once per shape of facts, with the same result as row by row.

``plan_changes`` runs the decision table and builds the evidence for the first row of each
shape and gives the other rows of that shape its decision and evidence with their own job
id, fence and ages. These properties draw batches over the evidence space (plans readable
or not, contradictory step records, unreadable facts, ages on and around the thresholds,
per-kind thresholds) where rows share shapes often, and check every row's planned change,
evidence text included, equals ``plan_change`` on that row alone: the table stays the one
source of truth.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.core.decisions import Thresholds
from reconciler.core.evidence import PlanStep
from reconciler.core.kinds import KindRule, KindRules
from reconciler.core.passes import PassConfig, plan_change, plan_changes
from reconciler.core.ports import Candidate, Cursor, Fence, PlannedChange
from reconciler.core.vocabulary import EffectKind, Reason, StepState

STALE, WEDGED = 60.0, 3600.0

PLANS: list[Any] = [
    None,
    "not json",
    "[]",
    '[{"step_name": "a", "effect_kind": "idempotent"}]',
    '[{"step_name": "a", "effect_kind": "idempotent"}, {"step_name": "b", "effect_kind": '
    '"pure"}, {"step_name": "c", "effect_kind": "effectful"}]',
    '[{"step_name": "a", "effect_kind": "effectful"}, {"step_name": "b", "effect_kind": '
    '"nonsense"}]',
    (PlanStep("only", EffectKind.EFFECTFUL),),
    (PlanStep("x", EffectKind.PURE), PlanStep("y", EffectKind.EFFECTFUL)),
]
STATES = [s.value for s in StepState] + ["bogus"]
AGES = st.one_of(
    st.none(),
    st.sampled_from([0.0, STALE - 0.001, STALE, WEDGED - 0.0005, WEDGED, -1.0, 1e9,
                     float("inf"), float("nan")]),
    st.floats(min_value=-10, max_value=2 * WEDGED),
)
STEP_ROWS = st.lists(
    st.tuples(st.integers(min_value=-1, max_value=3), st.sampled_from(STATES),
              st.sampled_from([None, True, False])),
    max_size=4,
).map(tuple)
KINDS = st.sampled_from(["plain", "fast.report"])  # the second has thresholds of its own
UNREADABLE = st.sampled_from([(), (("error_code", "unreadable_column"), ("column", "args"))])


@st.composite
def shapes(draw: st.DrawFn) -> Candidate:
    """A candidate of any shape: every fact the table reads drawn from a small domain."""
    return Candidate(
        job_id=0, job_kind=draw(KINDS), fence=Fence(1),
        attempt_count=draw(st.integers(0, 4)), max_attempts=draw(st.integers(0, 4)),
        operator_hold=draw(st.booleans()), lease_live=draw(st.booleans()),
        lease_expired_seconds=None, activity_age_seconds=None,
        plan=draw(st.sampled_from(PLANS)), step_rows=draw(STEP_ROWS),
        session_gone=draw(st.booleans()), lost_attempts_in_a_row=draw(st.integers(0, 4)),
        completion_recoverable=draw(st.booleans()), unreadable=draw(UNREADABLE),
    )


@st.composite
def batches(draw: st.DrawFn) -> list[Candidate]:
    """Up to 40 rows drawn from up to four shapes, each row with its own job id, kind, fence
    and ages (some ages that cannot be compared or rounded); a row in four has one fact of its
    shape changed, so rows differing in one fact only meet in a batch."""
    bases = draw(st.lists(shapes(), min_size=1, max_size=4))
    odd_age = st.sampled_from(["soon", b"x"])
    rows = []
    for job_id in range(1, draw(st.integers(1, 40)) + 1):
        expired = draw(st.one_of(AGES, odd_age) if draw(st.integers(0, 20)) == 0 else AGES)
        idle = draw(st.one_of(AGES, odd_age) if draw(st.integers(0, 20)) == 0 else AGES)
        row = dataclasses.replace(
            draw(st.sampled_from(bases)), job_id=job_id, job_kind=draw(KINDS),
            fence=Fence(draw(st.integers(1, 3))), position=Cursor((job_id, job_id)),
            lease_expired_seconds=expired, activity_age_seconds=idle)
        if draw(st.integers(0, 3)) == 0:
            fact = draw(st.sampled_from(SHAPE_FACTS))
            row = dataclasses.replace(row, **{fact: getattr(draw(shapes()), fact)})
        rows.append(row)
    return rows


SHAPE_FACTS = ("attempt_count", "max_attempts", "operator_hold", "lease_live",
               "plan", "step_rows", "session_gone", "lost_attempts_in_a_row",
               "completion_recoverable", "unreadable")


@st.composite
def configs(draw: st.DrawFn) -> PassConfig:
    """The default thresholds, with or without a crash-loop limit and per-kind tables."""
    crash_loop_after = draw(st.sampled_from([None, 1, 2, 3]))
    thresholds = Thresholds(STALE, WEDGED, crash_loop_after)
    kinds = None
    if draw(st.booleans()):
        kinds = KindRules([KindRule("fast.*", stale_after_seconds=1.0,
                                    wedged_after_seconds=STALE)],
                          stale_after_seconds=STALE, wedged_after_seconds=WEDGED,
                          max_attempts=3, crash_loop_after=crash_loop_after)
    return PassConfig(batch_size=500, thresholds=thresholds, kinds=kinds)


def _comparable(change: PlannedChange) -> tuple[Any, ...]:
    # The evidence as the audit stores it (JSON text, keys in order): NaN ages compare.
    return (change.decision, change.fence, change.thresholds, json.dumps(change.evidence))


EXAMPLES = int(os.environ.get("PLAN_BATCH_EXAMPLES", "150"))
"""Batches drawn per run: 150 in the README's command (each batch is up to hundreds of
rows, planned twice); ``PLAN_BATCH_EXAMPLES=2000`` for a deeper search after a change to
the planner."""


@settings(max_examples=EXAMPLES, deadline=None)
@given(batches(), configs())
def test_a_batch_plans_as_each_row_alone(rows: list[Candidate], config: PassConfig) -> None:
    """Every row's decision, fence, thresholds and evidence equal plan_change's."""
    logging.disable(logging.WARNING)  # reconcile_error rows log a line each
    try:
        got = plan_changes(rows, config)
        want = [plan_change(r, config.thresholds_for(r.job_kind)) for r in rows]
    finally:
        logging.disable(logging.NOTSET)
    assert [_comparable(c) for c in got] == [_comparable(c) for c in want]


def test_rows_of_one_shape_share_the_table_but_keep_their_own_facts() -> None:
    """Two jobs of one shape get one decision, each with its own id, fence and ages."""
    plan = PLANS[4]
    base = Candidate(0, "plain", Fence(1), 1, 3, False, False, None, None, plan,
                     ((0, "succeeded", None), (1, "started", None)))
    rows = [dataclasses.replace(base, job_id=7, fence=Fence(4), lease_expired_seconds=300.0,
                                activity_age_seconds=600.0),
            dataclasses.replace(base, job_id=8, fence=Fence(9), lease_expired_seconds=12.3456,
                                activity_age_seconds=900.0)]
    first, second = plan_changes(rows, PassConfig(500, Thresholds(STALE, WEDGED)))
    assert [c.decision.reason for c in (first, second)] == [Reason.RESUMED_IDEMPOTENT_STEP] * 2
    assert second.decision.resume_step_index == 1
    assert (second.decision.job_id, second.fence) == (8, Fence(9))
    assert (second.evidence["lease_expired_seconds"],
            second.evidence["activity_age_seconds"]) == (12.346, 900.0)
    assert first.evidence["lease_expired_seconds"] == 300.0


@pytest.mark.parametrize("age", ["soon", b"x"])
def test_an_age_that_cannot_be_rounded_is_that_rows_error(age: Any) -> None:
    """A row whose age breaks the evidence is a reconcile_error; its shape's others are not."""
    base = Candidate(0, "plain", Fence(1), 1, 3, False, False, 1.0, 600.0, PLANS[3], ())
    rows = [dataclasses.replace(base, job_id=1),
            dataclasses.replace(base, job_id=2, lease_expired_seconds=age),
            dataclasses.replace(base, job_id=3)]
    reasons = [c.decision.reason for c in plan_changes(rows, PassConfig(500, Thresholds(
        STALE, WEDGED)))]
    assert reasons == [Reason.RESUMED_FROM_UNSTARTED_STEP, Reason.RECONCILE_ERROR,
                       Reason.RESUMED_FROM_UNSTARTED_STEP]
