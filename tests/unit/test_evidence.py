"""Evidence values and step plan parsing: what the decision table may read, and nothing more."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from reconciler.core.evidence import (
    Evidence,
    EvidenceError,
    PlanStep,
    StepRecord,
    build_steps,
    parse_plan,
)
from reconciler.core.vocabulary import EffectKind, StepState

PLAN = (
    PlanStep("fetch-customer-secret", EffectKind.IDEMPOTENT),
    PlanStep("render-invoice-secret", EffectKind.PURE),
    PlanStep("charge-card-secret", EffectKind.EFFECTFUL),
)

PUBLIC_FACT_KEYS = {
    "attempts_used",
    "max_attempts",
    "operator_hold",
    "lease_live",
    "session_gone",
    "lease_expired_seconds",
    "activity_age_seconds",
    "plan_readable",
    "plan_length",
    "step_states",
    "effect_kinds",
    "first_unfinished_step",
    "lost_attempts_in_a_row",
    "completion_recoverable",
}


def evidence(plan: tuple[PlanStep, ...] | None = PLAN,
             steps: dict[int, StepRecord] | None = None, **fields: Any) -> Evidence:
    """Evidence of an expired claim; fields override the defaults."""
    values: dict[str, Any] = {
        "job_id": 41, "attempt_count": 2, "max_attempts": 5,
        "operator_hold": False, "lease_live": False, "lease_expired_seconds": 12.34567,
        "activity_age_seconds": 98.76543, "plan": plan, "steps": steps or {},
        "session_gone": False,
    }
    values.update(fields)
    return Evidence(**values)


def record(index: int, state: StepState, retryable: bool | None = None) -> StepRecord:
    """A step record."""
    return StepRecord(index, state, retryable)


class TestParsePlan:
    """parse_plan reads a stored plan, or says it is unreadable (None) without raising."""

    def test_parses_json_text(self) -> None:
        """A JSON list of step_name/effect_kind objects becomes PlanSteps in order."""
        raw = json.dumps([{"step_name": "fetch", "effect_kind": "idempotent"},
                          {"step_name": "render", "effect_kind": "pure"},
                          {"step_name": "publish", "effect_kind": "effectful"}])
        assert parse_plan(raw) == (
            PlanStep("fetch", EffectKind.IDEMPOTENT),
            PlanStep("render", EffectKind.PURE),
            PlanStep("publish", EffectKind.EFFECTFUL),
        )

    def test_parses_json_bytes(self) -> None:
        """A plan stored as UTF-8 bytes parses like text."""
        raw = b'[{"step_name": "fetch", "effect_kind": "pure"}]'
        assert parse_plan(raw) == (PlanStep("fetch", EffectKind.PURE),)

    def test_parses_an_already_decoded_list(self) -> None:
        """A plan a JSON column already decoded into a list parses too."""
        raw = [{"step_name": "only", "effect_kind": "effectful"}]
        assert parse_plan(raw) == (PlanStep("only", EffectKind.EFFECTFUL),)

    def test_effect_kinds_are_enum_members(self) -> None:
        """Parsed effect kinds are EffectKind members, not bare strings."""
        plan = parse_plan('[{"step_name": "a", "effect_kind": "pure"}]')
        assert plan is not None
        assert type(plan[0].effect_kind) is EffectKind

    def test_extra_keys_are_ignored(self) -> None:
        """Unknown keys beside step_name and effect_kind do not make a plan unreadable."""
        raw = '[{"step_name": "a", "effect_kind": "pure", "timeout_seconds": 5}]'
        assert parse_plan(raw) == (PlanStep("a", EffectKind.PURE),)

    @pytest.mark.parametrize(
        "raw",
        [
            pytest.param(None, id="missing"),
            pytest.param("", id="empty-text"),
            pytest.param("not json", id="invalid-json"),
            pytest.param("[{", id="truncated-json"),
            pytest.param(b"\xff\xfe\x00", id="undecodable-bytes"),
            pytest.param("[]", id="empty-list"),
            pytest.param([], id="empty-decoded-list"),
            pytest.param('{"step_name": "a", "effect_kind": "pure"}', id="object-not-list"),
            pytest.param('"a"', id="string-not-list"),
            pytest.param("42", id="number-not-list"),
            pytest.param("null", id="json-null"),
            pytest.param('["a"]', id="item-not-object"),
            pytest.param('[{"effect_kind": "pure"}]', id="missing-step-name"),
            pytest.param('[{"step_name": "a"}]', id="missing-effect-kind"),
            pytest.param('[{"step_name": "a", "effect_kind": "risky"}]', id="unknown-effect"),
            pytest.param('[{"step_name": "a", "effect_kind": "PURE"}]', id="effect-wrong-case"),
            pytest.param('[{"step_name": "a", "effect_kind": 1}]', id="effect-not-string"),
            pytest.param('[{"step_name": 7, "effect_kind": "pure"}]', id="name-not-string"),
            pytest.param('[{"step_name": null, "effect_kind": "pure"}]', id="name-null"),
            pytest.param('[{"step_name": "", "effect_kind": "pure"}]', id="name-empty"),
            pytest.param('[{"step_name": "a", "effect_kind": "pure"}, 3]', id="one-bad-item"),
            pytest.param('[{"step_name": "a", "effect_kind": "pure"},'
                         ' {"step_name": "b", "effect_kind": "nope"}]', id="one-bad-kind"),
        ],
    )
    def test_unreadable_plans_are_none(self, raw: Any) -> None:
        """A missing or malformed plan is None (rule 5: unresumable_plan), never an exception."""
        assert parse_plan(raw) is None


class TestBuildSteps:
    """build_steps turns stored step rows into records, refusing contradictions."""

    def test_builds_records_keyed_by_index(self) -> None:
        """Each row becomes a StepRecord under its step index, state parsed."""
        rows = [(0, "succeeded", None), (1, "failed", True), (2, "started", None)]
        assert build_steps(PLAN, rows) == {
            0: StepRecord(0, StepState.SUCCEEDED, None),
            1: StepRecord(1, StepState.FAILED, True),
            2: StepRecord(2, StepState.STARTED, None),
        }

    def test_no_rows_means_no_records(self) -> None:
        """A job whose steps never started has no records."""
        assert build_steps(PLAN, []) == {}

    @pytest.mark.parametrize("state", list(StepState))
    def test_every_step_state_is_accepted(self, state: StepState) -> None:
        """Each of the four stored step states parses to its member."""
        assert build_steps(PLAN, [(0, state.value, None)])[0].step_state is state

    def test_unknown_state_is_an_evidence_error(self) -> None:
        """A step row with a state outside the vocabulary cannot be evaluated."""
        with pytest.raises(EvidenceError, match="unknown state"):
            build_steps(PLAN, [(0, "exploded", None)])

    @pytest.mark.parametrize("index", [3, 99, -1])
    def test_index_outside_plan_is_an_evidence_error(self, index: int) -> None:
        """A step row beyond (or before) the plan contradicts the plan."""
        with pytest.raises(EvidenceError, match="outside the job's plan"):
            build_steps(PLAN, [(index, "started", None)])

    def test_rows_without_a_plan_are_kept(self) -> None:
        """With an unreadable plan there is nothing to contradict; rows are still recorded."""
        assert build_steps(None, [(5, "started", None)]) == {
            5: StepRecord(5, StepState.STARTED, None)}

    def test_evidence_error_is_a_value_error(self) -> None:
        """EvidenceError can be caught as ValueError."""
        assert issubclass(EvidenceError, ValueError)


class TestFirstUnfinished:
    """The first step that has not succeeded is where a resume would start."""

    def test_nothing_started_means_step_zero(self) -> None:
        """With no records the first unfinished step is step 0, never started."""
        ev = evidence()
        assert ev.first_unfinished_index == 0
        assert ev.first_unfinished is None
        assert ev.first_unfinished_effect is EffectKind.IDEMPOTENT

    def test_skips_the_succeeded_prefix(self) -> None:
        """Succeeded steps are passed over; the next step is the first unfinished."""
        ev = evidence(steps={0: record(0, StepState.SUCCEEDED),
                             1: record(1, StepState.SUCCEEDED)})
        assert ev.first_unfinished_index == 2
        assert ev.first_unfinished is None
        assert ev.first_unfinished_effect is EffectKind.EFFECTFUL

    def test_returns_the_record_of_a_started_step(self) -> None:
        """When the first unfinished step has a record, that record is returned."""
        started = record(1, StepState.STARTED)
        ev = evidence(steps={0: record(0, StepState.SUCCEEDED), 1: started})
        assert ev.first_unfinished_index == 1
        assert ev.first_unfinished == started
        assert ev.first_unfinished_effect is EffectKind.PURE

    def test_a_later_success_does_not_hide_an_earlier_gap(self) -> None:
        """Step 0 not succeeded is first unfinished even if step 1 succeeded."""
        ev = evidence(steps={0: record(0, StepState.FAILED, True),
                             1: record(1, StepState.SUCCEEDED)})
        assert ev.first_unfinished_index == 0
        assert ev.first_unfinished == record(0, StepState.FAILED, True)

    def test_all_succeeded_means_none(self) -> None:
        """When every step succeeded there is no first unfinished step."""
        ev = evidence(steps={i: record(i, StepState.SUCCEEDED) for i in range(3)})
        assert ev.first_unfinished_index is None
        assert ev.first_unfinished is None
        assert ev.first_unfinished_effect is None

    def test_no_plan_means_none(self) -> None:
        """Without a readable plan there is no first unfinished step."""
        ev = evidence(plan=None, steps={0: record(0, StepState.STARTED)})
        assert ev.first_unfinished_index is None
        assert ev.first_unfinished is None
        assert ev.first_unfinished_effect is None

    def test_records_beyond_the_plan_are_ignored(self) -> None:
        """A record past the end of the plan does not count as an unfinished step."""
        steps = {i: record(i, StepState.SUCCEEDED) for i in range(3)}
        steps[7] = record(7, StepState.STARTED)
        assert evidence(steps=steps).first_unfinished_index is None


class TestPublicFacts:
    """public_facts is what the audit trail stores: states, ages, attempts; no identities."""

    def test_only_the_documented_keys(self) -> None:
        """The facts have exactly the documented keys."""
        assert set(evidence().public_facts()) == PUBLIC_FACT_KEYS

    def test_values(self) -> None:
        """Attempts, flags, rounded ages, plan shape and step states are reported."""
        ev = evidence(steps={0: record(0, StepState.SUCCEEDED),
                             1: record(1, StepState.STARTED)},
                      operator_hold=True, lease_live=True, session_gone=True)
        assert ev.public_facts() == {
            "attempts_used": 2,
            "max_attempts": 5,
            "operator_hold": True,
            "lease_live": True,
            "session_gone": True,
            "lease_expired_seconds": 12.346,
            "activity_age_seconds": 98.765,
            "plan_readable": True,
            "plan_length": 3,
            "step_states": ["succeeded", "started", "not_started"],
            "effect_kinds": ["idempotent", "pure", "effectful"],
            "first_unfinished_step": 1,
            "lost_attempts_in_a_row": 0,
            "completion_recoverable": False,
        }

    def test_crash_loop_and_completion_facts(self) -> None:
        """The lost-attempt count and the source's completion flag are recorded as given."""
        facts = evidence(lost_attempts_in_a_row=3, completion_recoverable=True).public_facts()
        assert (facts["lost_attempts_in_a_row"], facts["completion_recoverable"]) == (3, True)

    def test_sources_that_keep_no_attempts_default_to_no_crash_loop(self) -> None:
        """Evidence built without the new facts has no lost attempts and no recoverable
        completion, so the rules they feed never match."""
        ev = evidence()
        assert (ev.lost_attempts_in_a_row, ev.completion_recoverable) == (0, False)

    def test_steps_without_a_record_are_not_started(self) -> None:
        """A step that never started is reported as not_started."""
        assert evidence().public_facts()["step_states"] == ["not_started"] * 3

    def test_unreadable_plan(self) -> None:
        """Without a plan, plan-derived facts are None and plan_readable is False."""
        facts = evidence(plan=None, activity_age_seconds=None,
                         lease_expired_seconds=None).public_facts()
        assert facts["plan_readable"] is False
        assert facts["plan_length"] is None
        assert facts["step_states"] is None
        assert facts["effect_kinds"] is None
        assert facts["first_unfinished_step"] is None
        assert facts["activity_age_seconds"] is None
        assert facts["lease_expired_seconds"] is None

    def test_no_step_names_or_identities(self) -> None:
        """Step names and the job id never appear in the recorded facts."""
        ev = evidence(job_id=987_654_321,
                      steps={0: record(0, StepState.FAILED, False)})
        text = json.dumps(ev.public_facts())
        assert "secret" not in text
        for step in PLAN:
            assert step.step_name not in text
        assert "987654321" not in text

    def test_facts_are_json_serialisable(self) -> None:
        """The facts round-trip through JSON unchanged (they are stored as a JSON column)."""
        facts = evidence(steps={0: record(0, StepState.WAITING)}).public_facts()
        assert json.loads(json.dumps(facts)) == facts


class TestPlanStep:
    """PlanStep validates itself when built."""

    @pytest.mark.parametrize("kind", ["pure", "idempotent", "effectful"])
    def test_string_effect_kinds_are_coerced(self, kind: str) -> None:
        """An effect kind given as text becomes the EffectKind member."""
        step = PlanStep("a", kind)  # type: ignore[arg-type]
        assert step.effect_kind is EffectKind(kind)

    def test_bad_effect_kind_is_refused_with_a_clear_message(self) -> None:
        """An unknown effect kind raises ValueError naming the step and the allowed kinds."""
        with pytest.raises(ValueError, match="effect_kind") as caught:
            PlanStep("publish", "risky")  # type: ignore[arg-type]
        message = str(caught.value)
        assert "'publish'" in message
        assert "pure, idempotent, effectful" in message
        assert "\n" not in message

    @pytest.mark.parametrize("name", ["", None, 3])
    def test_name_must_be_non_empty_text(self, name: Any) -> None:
        """A step without a non-empty string name is refused."""
        with pytest.raises(ValueError, match="non-empty name"):
            PlanStep(name, EffectKind.PURE)

    def test_plan_steps_are_immutable(self) -> None:
        """A plan step cannot be changed after it is built."""
        step = PlanStep("a", EffectKind.PURE)
        with pytest.raises(dataclasses.FrozenInstanceError):
            step.effect_kind = EffectKind.EFFECTFUL  # type: ignore[misc]

    def test_evidence_is_immutable(self) -> None:
        """Evidence cannot be changed after it is built."""
        with pytest.raises(dataclasses.FrozenInstanceError):
            evidence().operator_hold = True  # type: ignore[misc]
