"""What every view of one job says about it, derived from the facts a pass reads: the
system's row, the step ledger, the audit's decisions and the operators' actions.

Pure: facts in, the job's public reading out. ``jobs show``, ``jobs list`` and the console
all take a foreign job's reason, resume step, budget and times from here, so they cannot
drift apart (the native source's row keeps the same facts itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from reconciler.core.evidence import PlanStep
from reconciler.core.policy import first_unfinished_step
from reconciler.core.vocabulary import JobKey, JobStatus, StepState

ENDED = frozenset({JobStatus.COMPLETED.value, JobStatus.FAILED.value,
                   JobStatus.CANCELLED.value})
WILL_RUN = frozenset({JobStatus.QUEUED.value, JobStatus.PROCESSING.value})

BUDGET_OF_THE_JOB = "job"
"""``max_attempts_from`` when the job's own row (the system's own retry setting) sets it."""
BUDGET_DEFAULT = "default"
"""``max_attempts_from`` when the settings' default applies (no ``[kinds]`` pattern sets it)."""


@dataclass(frozen=True, slots=True)
class JobDetail:
    """Every column a public view may draw from (the view decides what to show).

    A foreign source's job has its id as its system spells it, its status in this
    project's words where one fits (``source_status``: the system's own), and no times
    nor attempt count (None) where the system keeps none.
    """

    job_id: JobKey
    job_kind: str
    job_status: str
    status_reason: str | None
    attempt_count: int | None
    max_attempts: int
    resume_step_index: int | None
    """None: the job will not run again (a foreign job that ended), so resumes nowhere."""
    plan: str | tuple[PlanStep, ...] | None
    """The step plan: a native job's stored text, a foreign job's from its step ledger."""
    operator_hold: bool
    last_error_code: str | None
    created_at: datetime | None
    updated_at: datetime | None
    finished_at: datetime | None
    step_states: dict[int, str]
    source_status: str | None = None
    """A foreign job's status as its own system names it (None: this project's job)."""
    max_attempts_from: str = "job"
    """Where ``max_attempts`` comes from: the job's own row (``job``), the
    ``[kinds."PATTERN"]`` that sets it, or the settings' ``default``."""


@dataclass(frozen=True, slots=True)
class LastMove:
    """The newest change the audit records of a job: a pass's resume or terminalization,
    or an operator's retry or cancel, applied (never a skip, a shadow decision or a
    refused action: those moved nothing)."""

    at: datetime
    reason: str
    """The decision's reason, or ``operator_retry`` / ``operator_cancel``."""
    ended: bool
    """Whether the move ended the job (a terminalization, a cancel) or queued it again."""


def current_reason(status: str, system_reason: str | None, last: LastMove | None
                   ) -> str | None:
    """The reason that applies to the job now.

    The newest move's, while the job is still where that move left it (queued again, or
    ended); once the system moved it since (a worker claimed it, or ran it to an end of
    its own) that reason is history. An ended job the audit did not end shows the
    system's own reason code, if any; a job that will run again has no terminal reason,
    whatever the system's row still carries from before a retry.
    """
    if last is not None and last.ended == (status in ENDED) and (
            last.ended or status == JobStatus.QUEUED.value):
        return last.reason
    return system_reason if status in ENDED else None


def budget_from(system_budget: int | None, set_by_pattern: str | None) -> str:
    """Where a job's attempt budget comes from: the job's own row (``job``), the
    ``[kinds."PATTERN"]`` that sets it, or the settings' ``default``."""
    if system_budget is not None:
        return BUDGET_OF_THE_JOB
    return BUDGET_DEFAULT if set_by_pattern is None else f'[kinds."{set_by_pattern}"]'


def resume_step(status: str, plan: tuple[PlanStep, ...] | None,
                states: Mapping[int, str], own: int | None = None) -> int | None:
    """The step a job that will run again resumes at: the system's ``own`` record of it
    where it keeps one, else as a pass computes it, the first step of its plan that has
    not succeeded (0 without a plan); None for a job that ended (it resumes nowhere)."""
    if status not in WILL_RUN:
        return None
    if own is not None:
        return own
    return first_unfinished_step(len(plan or ()), {
        i for i, state in states.items() if state == StepState.SUCCEEDED.value})


def aware(moment: datetime | None) -> datetime | None:
    """A stored time with its offset: one read back without one (SQLite, a temporary
    table, MySQL's DATETIME) is UTC, as every time this project and the systems write."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


def latest(*moments: datetime | None) -> datetime | None:
    """The newest of these times (None when none is known): a job's ``updated_at`` only
    moves forward, whichever of its system and the audit wrote last."""
    known = [m for m in (aware(m) for m in moments) if m is not None]
    return max(known) if known else None


@dataclass(frozen=True, slots=True)
class Reading:
    """One job as every view shows it."""

    reason: str | None
    resume_step_index: int | None
    max_attempts: int
    max_attempts_from: str
    updated_at: datetime | None
    finished_at: datetime | None


def read_job(status: str, *, system_reason: str | None, system_budget: int | None,
             kind_budget: int, budget_pattern: str | None,
             plan: tuple[PlanStep, ...] | None, states: Mapping[int, str],
             system_resume_step: int | None = None,
             system_updated: datetime | None, system_finished: datetime | None,
             moves: tuple[LastMove | None, ...]) -> Reading:
    """A job's public reading from what a pass reads of it: its system's row (``status``
    in this project's words, the system's reason, budget, times and resume step where it
    keeps one), its kind's budget
    and the ``[kinds]`` pattern that set it, its step ledger, and the newest moves the
    audit and the operators' record hold (either may be None).

    Its ``finished_at`` is when it ended (the system's own finish time, else the move that
    ended it), None while it will run; ``updated_at`` the newest of its system's time and
    the moves', so it never goes back when the system clears a time on a retry.
    """
    known = [m for m in moves if m is not None]
    last = max(known, key=lambda m: aware(m.at) or _EPOCH) if known else None
    ended = status in ENDED
    finished = None
    if ended:
        finished = aware(system_finished) or (aware(last.at) if last and last.ended else None)
    return Reading(
        reason=current_reason(status, system_reason, last),
        resume_step_index=resume_step(status, plan, states, system_resume_step),
        max_attempts=kind_budget if system_budget is None else system_budget,
        max_attempts_from=budget_from(system_budget, budget_pattern),
        updated_at=latest(system_updated, system_finished, last.at if last else None),
        finished_at=finished)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
