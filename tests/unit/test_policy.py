"""The lease contract's rules that are not storage: backoff, attempt outcomes, the resume
point and the operator state machine, as pure functions."""

from __future__ import annotations

import itertools

import pytest

from reconciler.core.policy import (
    OperatorChange,
    Refusal,
    first_unfinished_step,
    lost_in_a_row,
    operator_change,
    reclaimed_attempt_outcome,
    retry_delay_seconds,
)
from reconciler.core.vocabulary import (
    AttemptOutcome,
    JobStatus,
    OperatorAction,
    OperatorStatusReason,
    Reason,
)


class TestRetryDelay:
    def test_the_first_failure_waits_the_first_delay_then_it_doubles(self) -> None:
        """Attempts 1, 2, 3, 4 wait 1, 2, 4, 8 seconds from a first delay of 1."""
        assert [retry_delay_seconds(n, 1.0, 300.0) for n in (1, 2, 3, 4)] == [1, 2, 4, 8]

    def test_the_delay_stops_at_the_cap(self) -> None:
        """No delay exceeds the cap, however many attempts were used."""
        assert retry_delay_seconds(20, 1.0, 300.0) == 300.0
        assert retry_delay_seconds(10**9, 1.0, 300.0) == 300.0

    def test_zero_attempts_is_read_as_the_first(self) -> None:
        """A count below one never shrinks the delay below the first."""
        assert retry_delay_seconds(0, 2.0, 300.0) == 2.0


class TestReclaimedAttemptOutcome:
    def test_a_wedged_attempt_is_abandoned_a_recovered_one_completed_the_rest_lost(
        self,
    ) -> None:
        """Only worker_wedged may still be running; a recovered completion did its work;
        the rest lost their worker."""
        assert reclaimed_attempt_outcome(Reason.WORKER_WEDGED) is AttemptOutcome.ABANDONED
        assert reclaimed_attempt_outcome(Reason.COMPLETION_RECOVERED) is (
            AttemptOutcome.COMPLETED)
        for reason in set(Reason) - {Reason.WORKER_WEDGED, Reason.COMPLETION_RECOVERED}:
            assert reclaimed_attempt_outcome(reason) is AttemptOutcome.LOST


class TestLostInARow:
    @pytest.mark.parametrize(("history", "expected"), [
        ([], 0),
        ([(1, None, None)], 1),
        ([(2, None, None), (1, "lost", "reconciler")], 2),
        ([(3, None, None), (2, "lost", "reconciler"), (1, "lost", "reconciler")], 3),
        ([(3, None, None), (2, "retrying", "worker"), (1, "lost", "reconciler")], 1),
        ([(2, None, None), (1, "lost", "operator")], 1),
        # An operator's retry restarts the numbering: the earlier losses do not count.
        ([(1, None, None), (3, "lost", "reconciler"), (2, "lost", "reconciler")], 1),
        ([(2, "completed", "worker"), (1, "lost", "reconciler")], 0),
    ])
    def test_counts_the_open_attempt_and_the_losses_right_before_it(
        self, history: list[tuple[int, str | None, str | None]], expected: int
    ) -> None:
        """Newest first: the open attempt, then each consecutive reconciler-ended loss."""
        assert lost_in_a_row(history) == expected


class TestFirstUnfinishedStep:
    @pytest.mark.parametrize(("length", "done", "expected"), [
        (3, set(), 0), (3, {0}, 1), (3, {0, 2}, 1), (3, {0, 1, 2}, 3), (0, set(), 0),
        (2, {5}, 0),
    ])
    def test_the_first_index_not_succeeded(self, length: int, done: set[int],
                                           expected: int) -> None:
        """The resume point is the first gap; with none, the plan's length."""
        assert first_unfinished_step(length, done) == expected


class TestOperatorChange:
    LIVE = (JobStatus.QUEUED, JobStatus.PROCESSING, JobStatus.WAITING)
    TERMINAL = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)

    def test_hold_and_unhold_toggle_a_live_job_only(self) -> None:
        """A live job is held or released; twice the same way is refused."""
        for status in self.LIVE:
            assert operator_change(OperatorAction.HOLD, status, False) == OperatorChange(
                hold=True)
            assert operator_change(OperatorAction.UNHOLD, status, True) == OperatorChange(
                hold=False)
            assert operator_change(OperatorAction.HOLD, status, True) is Refusal.ALREADY_HELD
            assert operator_change(OperatorAction.UNHOLD, status, False) is Refusal.NOT_HELD

    def test_nothing_but_retry_touches_a_finished_job(self) -> None:
        """Hold and cancel of a terminal job are refused; a hold it still carries (set
        while it ran) is lifted, which changes nothing else, and only a hold is."""
        for status, held, action in itertools.product(
                self.TERMINAL, (False, True), (OperatorAction.HOLD, OperatorAction.CANCEL)):
            assert operator_change(action, status, held) is Refusal.JOB_TERMINAL
        for status in self.TERMINAL:
            assert operator_change(OperatorAction.UNHOLD, status, True) == OperatorChange(
                hold=False)
            assert operator_change(OperatorAction.UNHOLD, status, False) is Refusal.NOT_HELD

    def test_retry_requeues_failed_or_cancelled_with_a_fresh_budget(self) -> None:
        """A retry is a transition to queued that restarts the attempt budget."""
        for status in (JobStatus.FAILED, JobStatus.CANCELLED):
            change = operator_change(OperatorAction.RETRY, status, False)
            assert change == OperatorChange(
                new_status=JobStatus.QUEUED,
                status_reason=OperatorStatusReason.OPERATOR_RETRY, restart_budget=True)
            assert isinstance(change, OperatorChange)
            assert change.bumps_generation

    def test_retry_never_rewinds_a_live_or_completed_job(self) -> None:
        """Completed work is not redone, and a live job's attempts are not reset."""
        for status in (*self.LIVE, JobStatus.COMPLETED):
            assert operator_change(OperatorAction.RETRY, status, False) is (
                Refusal.JOB_NOT_FAILED_OR_CANCELLED)

    def test_cancel_fences_the_worker_out(self) -> None:
        """A cancel of a live job ends it cancelled, drops the lease, bumps the generation."""
        for status in self.LIVE:
            change = operator_change(OperatorAction.CANCEL, status, False)
            assert change == OperatorChange(
                new_status=JobStatus.CANCELLED,
                status_reason=OperatorStatusReason.OPERATOR_CANCEL, drop_lease=True)
            assert isinstance(change, OperatorChange)
            assert change.bumps_generation

    def test_a_hold_is_no_transition(self) -> None:
        """Holding keeps the generation: the worker of a held job keeps its claim."""
        change = operator_change(OperatorAction.HOLD, JobStatus.PROCESSING, False)
        assert isinstance(change, OperatorChange)
        assert not change.bumps_generation
