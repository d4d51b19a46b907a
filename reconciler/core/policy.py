"""Rules of the lease contract that are not storage: pure functions the stores apply.

Retry backoff, how an attempt ends when the reconciler takes its claim away, the first
step a resumed run starts at, and the operator state machine. Storage turns their answers
into column values; keeping them here lets every source and every store agree, and lets
them be tested without a database.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum

from reconciler.core.vocabulary import (
    AttemptOutcome,
    EndedBy,
    JobStatus,
    OperatorAction,
    OperatorStatusReason,
    Reason,
)


def retry_delay_seconds(attempts_used: int, first_delay_seconds: float,
                        max_delay_seconds: float) -> float:
    """The wait before a retryable failure runs again: doubling from the first delay, capped.

    ``attempts_used`` counts the attempt that just failed (the first failure waits the
    first delay).
    """
    exponent = max(attempts_used - 1, 0)
    # Past 2**64 the cap has long won; the bound keeps the float from overflowing.
    if exponent >= 64:
        return max_delay_seconds
    return min(first_delay_seconds * float(2 ** exponent), max_delay_seconds)


# Skips that stay true until someone else acts (an operator, the gate's worker): once
# recorded, the job is parked out of the scans instead of filling every batch.
PARKING_REASONS = frozenset({Reason.OPERATOR_HOLD, Reason.WAITING_ON_GATE})


def reclaimed_attempt_outcome(reason: Reason) -> AttemptOutcome:
    """How an attempt ends when the reconciler takes its claim away.

    A wedged worker may still be running (``abandoned``); a recovered completion finished
    the attempt's work (``completed``); any other stale claim lost its worker (``lost``).
    """
    if reason is Reason.WORKER_WEDGED:
        return AttemptOutcome.ABANDONED
    if reason is Reason.COMPLETION_RECOVERED:
        return AttemptOutcome.COMPLETED
    return AttemptOutcome.LOST


def lost_in_a_row(history: Sequence[tuple[int, str | None, str | None]]) -> int:
    """How many attempts, newest first, died without their worker saying so: the open one
    being judged, then each earlier one the reconciler ended ``lost``. ``history`` is
    (attempt number, outcome, ended by), newest first. An operator's retry restarts the
    numbering, and stops the count, so a retried job gets a fresh chance."""
    if not history or history[0][1] is not None:
        return 0
    count, number = 1, history[0][0]
    for earlier, outcome, ended_by in history[1:]:
        if (earlier != number - 1 or outcome != AttemptOutcome.LOST.value
                or ended_by != EndedBy.RECONCILER.value):
            break
        count, number = count + 1, earlier
    return count


def first_unfinished_step(plan_length: int, succeeded: Collection[int]) -> int:
    """The index a resumed run starts at: the first step not yet succeeded, or the plan's
    length when all have (nothing left to run)."""
    return next((i for i in range(plan_length) if i not in succeeded), plan_length)


class Refusal(StrEnum):
    """Why an operator action was not applied."""

    NO_SUCH_JOB = "no_such_job"
    JOB_TERMINAL = "job_terminal"
    ALREADY_HELD = "already_held"
    NOT_HELD = "not_held"
    JOB_NOT_FAILED_OR_CANCELLED = "job_not_failed_or_cancelled"
    FENCE_LOST = "fence_lost"


TERMINAL_STATUSES = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED})
RETRYABLE_STATUSES = frozenset({JobStatus.FAILED, JobStatus.CANCELLED})


@dataclass(frozen=True, slots=True)
class OperatorChange:
    """What an applied operator action changes; storage writes it as one fenced update.

    ``new_status`` None keeps the status. A retry restarts the attempt budget and resumes
    at the first unfinished step; a cancel drops the lease, so the worker is fenced out.
    Any change of status bumps the generation.
    """

    new_status: JobStatus | None = None
    status_reason: OperatorStatusReason | None = None
    hold: bool | None = None
    restart_budget: bool = False
    drop_lease: bool = False

    @property
    def bumps_generation(self) -> bool:
        """A status change is a transition: it fences out whoever held the old generation."""
        return self.new_status is not None


def operator_change(action: OperatorAction, status: JobStatus, held: bool
                    ) -> OperatorChange | Refusal:
    """The change an operator action makes to a job in ``status``, or why it is refused."""
    if action is OperatorAction.UNHOLD:
        # A hold is liftable for as long as it exists: the job may have ended meanwhile (its
        # system finished it, an operator cancelled it), and lifting changes nothing else.
        return OperatorChange(hold=False) if held else Refusal.NOT_HELD
    if action is OperatorAction.HOLD:
        if status in TERMINAL_STATUSES:
            return Refusal.JOB_TERMINAL
        return Refusal.ALREADY_HELD if held else OperatorChange(hold=True)
    if action is OperatorAction.RETRY:
        if status not in RETRYABLE_STATUSES:
            # Never rewinds a live job's attempt count; completed work is not redone.
            return Refusal.JOB_NOT_FAILED_OR_CANCELLED
        return OperatorChange(new_status=JobStatus.QUEUED,
                              status_reason=OperatorStatusReason.OPERATOR_RETRY,
                              restart_budget=True)
    if status in TERMINAL_STATUSES:
        return Refusal.JOB_TERMINAL
    return OperatorChange(new_status=JobStatus.CANCELLED,
                          status_reason=OperatorStatusReason.OPERATOR_CANCEL, drop_lease=True)
