"""Frozen evidence about one stale-claim candidate, and step plan parsing.

Evidence holds only what the decision table reads: states, effect kinds, ages in seconds
measured by the database's clock, and attempt counts. No payload, owner or message.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reconciler.core.vocabulary import EffectKind, JobKey, StepState


class EvidenceError(ValueError):
    """The stored facts about a job contradict each other; the job cannot be evaluated.

    ``detail`` says where, privacy-safe, for the decision's evidence: an ``error_code``
    and the step index or column name it concerns, never a stored value or a message.
    """

    def __init__(self, message: str, **detail: str | int) -> None:
        super().__init__(message)
        self.detail: dict[str, str | int] = detail


@dataclass(frozen=True, slots=True)
class PlanStep:
    """One step of a plan: its name and what running it may do to the world."""

    step_name: str
    effect_kind: str
    """One of ``pure``, ``idempotent``, ``effectful``; stored as an ``EffectKind``."""

    def __post_init__(self) -> None:
        if not isinstance(self.step_name, str) or not self.step_name:
            raise ValueError("a step needs a non-empty name")
        try:
            object.__setattr__(self, "effect_kind", EffectKind(self.effect_kind))
        except ValueError:
            raise ValueError(
                f"step {self.step_name!r}: effect_kind must be one of "
                f"{', '.join(k.value for k in EffectKind)}"
            ) from None

    @property
    def kind(self) -> EffectKind:
        """The effect kind as the enum."""
        return EffectKind(self.effect_kind)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """The latest recorded state of one step."""

    step_index: int
    step_state: StepState
    failure_retryable: bool | None = None


StepRows = tuple[tuple[int, str, bool | None], ...]
"""A job's step records as read: (step index, state, whether a failure is retryable)."""


@dataclass(frozen=True, slots=True)
class StepFacts:
    """A job's steps as evidence: its plan, its step records, its last recorded activity."""

    plan: tuple[PlanStep, ...]
    step_rows: StepRows
    activity_age_seconds: float | None


@dataclass(frozen=True, slots=True)
class Evidence:
    """What the reconciler knows about one processing job, as of one database instant."""

    job_id: JobKey
    attempt_count: int
    max_attempts: int
    operator_hold: bool
    lease_live: bool
    lease_expired_seconds: float | None
    activity_age_seconds: float | None
    plan: tuple[PlanStep, ...] | None
    steps: Mapping[int, StepRecord] = field(default_factory=dict)
    session_gone: bool = False
    lost_attempts_in_a_row: int = 0
    """How many of the job's most recent attempts ended lost: the worker died and recorded
    no outcome. The attempt being decided counts as one (a job that reaches the crash-loop
    rule has a dead worker), plus each older attempt the reconciler closed as ``lost``,
    newest first. The count stops at the first attempt ended any other way (by its worker,
    as ``abandoned``, by an operator) and at an operator's retry, which starts the job
    afresh. 0 when the source keeps no attempts: the crash-loop rule then never matches."""
    completion_recoverable: bool = False
    """The source can finish this job ``completed`` itself, safely again under the fence:
    the native source sets it when every step succeeded and every artifact the job staged
    is a ``staged`` record of the current ``claim_generation`` (so publishing that set
    publishes all of its output). Other sources leave it False."""
    first_unfinished_index: int | None = field(init=False, default=None)
    """Index of the first step that has not succeeded; None when all have (or no plan)."""

    def __post_init__(self) -> None:
        # Derived once: every rule of the table reads it.
        if self.plan is not None:
            steps = self.steps
            for i in range(len(self.plan)):
                record = steps.get(i)
                if record is None or record.step_state is not StepState.SUCCEEDED:
                    object.__setattr__(self, "first_unfinished_index", i)
                    break

    @property
    def first_unfinished(self) -> StepRecord | None:
        """The record of the first unfinished step (None when it never started)."""
        index = self.first_unfinished_index
        return None if index is None else self.steps.get(index)

    @property
    def first_unfinished_effect(self) -> EffectKind | None:
        """Effect kind of the first unfinished step, from the plan."""
        index = self.first_unfinished_index
        return None if index is None or self.plan is None else self.plan[index].kind

    def public_facts(self) -> dict[str, Any]:
        """Privacy-safe facts recorded beside a decision: states, ages, attempts."""
        plan, steps = self.plan, self.steps
        plan_length = states = kinds = None
        if plan is not None:
            # Plain text, not the StrEnum members: JSON-encoding a member costs twice a str,
            # and str() of a member (its value) costs a fifth of ``.value``.
            plan_length = len(plan)
            states = [str(steps[i].step_state) if i in steps else "not_started"
                      for i in range(plan_length)]
            kinds = [str(step.effect_kind) for step in plan]  # an EffectKind: its text
        return {
            "attempts_used": self.attempt_count,
            "max_attempts": self.max_attempts,
            "operator_hold": self.operator_hold,
            "lease_live": self.lease_live,
            "session_gone": self.session_gone,
            "lease_expired_seconds": round_age(self.lease_expired_seconds),
            "activity_age_seconds": round_age(self.activity_age_seconds),
            "plan_readable": self.plan is not None,
            "plan_length": plan_length,
            "step_states": states,
            "effect_kinds": kinds,
            "first_unfinished_step": self.first_unfinished_index,
            "lost_attempts_in_a_row": self.lost_attempts_in_a_row,
            "completion_recoverable": self.completion_recoverable,
        }


def round_age(value: float | None) -> float | None:
    """An age as the evidence records it: to the millisecond."""
    return None if value is None else round(value, 3)


def parse_plan(raw: str | bytes | Sequence[Any] | None) -> tuple[PlanStep, ...] | None:
    """Parse a stored step plan; None when it is missing or unreadable (rule 5).

    A tuple of ``PlanStep`` is a plan a source built itself, already valid.
    """
    if raw is None:
        return None
    if isinstance(raw, tuple) and raw and all(isinstance(s, PlanStep) for s in raw):
        return raw
    if isinstance(raw, str):
        return _parse_plan_text(raw)
    try:
        data = json.loads(raw) if isinstance(raw, bytes) else raw
    except ValueError:
        return None
    return _plan_from(data)


@functools.lru_cache(maxsize=1024)
def _parse_plan_text(raw: str) -> tuple[PlanStep, ...] | None:
    # Jobs of one kind share a plan: a batch parses each distinct text once.
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return _plan_from(data)


def _plan_from(data: Any) -> tuple[PlanStep, ...] | None:
    if not isinstance(data, list) or not data:
        return None
    steps: list[PlanStep] = []
    for item in data:
        if not isinstance(item, dict):
            return None
        name, kind = item.get("step_name"), item.get("effect_kind")
        if not isinstance(name, str) or not name or not isinstance(kind, str):
            return None
        try:
            steps.append(PlanStep(name, EffectKind(kind)))
        except ValueError:
            return None
    return tuple(steps)


_STEP_STATES: dict[str, StepState] = {state.value: state for state in StepState}


def build_steps(
    plan: tuple[PlanStep, ...] | None, rows: Sequence[tuple[int, str, bool | None]]
) -> dict[int, StepRecord]:
    """Step records keyed by index; raises EvidenceError when they contradict the plan."""
    records: dict[int, StepRecord] = {}
    for step_index, state, retryable in rows:
        step_state = _STEP_STATES.get(state)
        if step_state is None:
            raise EvidenceError("step record has an unknown state",
                                error_code="unknown_step_state", step=step_index)
        if plan is not None and not 0 <= step_index < len(plan):
            raise EvidenceError("step record lies outside the job's plan",
                                error_code="step_outside_plan", step=step_index,
                                plan_length=len(plan))
        records[step_index] = StepRecord(step_index, step_state, retryable)
    return records
