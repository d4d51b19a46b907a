"""The mass-staleness brake: when it engages, how long it holds, and what a braked pass records."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.config.settings import load_settings
from reconciler.core.brake import (
    BrakeLimits,
    BrakeState,
    apply_brake,
    brake,
    count_limit,
    over_limits,
)
from reconciler.core.decisions import Decision
from reconciler.core.vocabulary import Disposition, Reason

LIMITS = BrakeLimits(min_jobs=20, stale_fraction=0.5, hold_seconds=120.0)
T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    """The database time ``seconds`` after T0."""
    return T0 + timedelta(seconds=seconds)


class TestLimits:
    """At least min_jobs stale jobs, and at least stale_fraction of the running ones."""

    @pytest.mark.parametrize(("stale", "running", "over"), [
        (20, 40, True),    # exactly both limits
        (19, 38, False),   # half of running, one short of min_jobs
        (20, 41, False),   # min_jobs, just under half
        (21, 41, True),
        (1000, 1000, True),
        (0, 0, False),
        (0, 100, False),
        (25, 10, True),    # read at different instants: running taken as at least stale
        (19, 0, False),
    ])
    def test_edges(self, stale: int, running: int, over: bool) -> None:
        """Both limits are inclusive; missing either keeps the brake off."""
        assert over_limits(stale, running, LIMITS) is over

    def test_negative_counts_are_refused(self) -> None:
        """A negative count is a bug in the caller, not a reading."""
        with pytest.raises(ValueError, match="negative"):
            over_limits(-1, 10, LIMITS)
        with pytest.raises(ValueError, match="negative"):
            brake(5, -1, LIMITS, None, T0)

    @pytest.mark.parametrize(("field", "value"), [
        ("min_jobs", 0), ("stale_fraction", 0.0), ("stale_fraction", 1.01),
        ("hold_seconds", -1.0), ("hold_seconds", float("nan"))])
    def test_bad_limits_are_refused(self, field: str, value: float) -> None:
        """Limits outside their ranges raise one line naming the limit."""
        with pytest.raises(ValueError, match=field) as caught:
            dataclasses.replace(LIMITS, **{field: value})  # type: ignore[arg-type]
        assert "\n" not in str(caught.value)

    def test_settings_build_the_limits_with_the_documented_defaults(self) -> None:
        """brake_min_jobs 20, brake_stale_fraction 0.5, brake_hold_seconds 120."""
        assert load_settings().brake_limits() == LIMITS


class TestHold:
    """Engaged for hold_seconds from the first braked pass, then released until it clears."""

    def test_first_braked_pass_engages_and_remembers_when(self) -> None:
        """Over the limits with no event in progress: engaged, since now."""
        assert brake(30, 40, LIMITS, None, T0) == BrakeState(engaged=True, engaged_since=T0)

    def test_under_the_limits_nothing_is_remembered(self) -> None:
        """Under the limits the brake is off and any event is forgotten."""
        assert brake(19, 40, LIMITS, None, T0) == BrakeState(False, None)
        assert brake(19, 40, LIMITS, at(-30), T0) == BrakeState(False, None)

    def test_held_until_just_before_hold_seconds(self) -> None:
        """Passes within hold_seconds of the first braked pass stay braked."""
        assert brake(30, 40, LIMITS, T0, at(119.999)) == BrakeState(True, T0)

    def test_released_at_hold_seconds(self) -> None:
        """At hold_seconds the jobs still stale are decided normally; the event is kept."""
        assert brake(30, 40, LIMITS, T0, at(120)) == BrakeState(False, T0)

    def test_stays_released_while_the_event_lasts(self) -> None:
        """A real mass death costs one hold: the brake does not engage again while it lasts."""
        assert brake(30, 40, LIMITS, T0, at(3600)) == BrakeState(False, T0)

    def test_a_new_event_after_recovery_engages_again(self) -> None:
        """Once the count fell under the limits, the next event brakes afresh."""
        cleared = brake(2, 40, LIMITS, T0, at(200))
        assert cleared == BrakeState(False, None)
        assert brake(30, 40, LIMITS, cleared.engaged_since, at(500)) == BrakeState(True, at(500))

    def test_zero_hold_never_brakes(self) -> None:
        """brake_hold_seconds 0 turns the brake off."""
        limits = dataclasses.replace(LIMITS, hold_seconds=0.0)
        assert brake(1000, 1000, limits, None, T0).engaged is False

    def test_a_clock_stepped_back_restarts_the_hold(self) -> None:
        """A database clock stepped back an hour brakes for one hold from now, not an hour."""
        stepped = brake(30, 40, LIMITS, T0, at(-3600))
        assert stepped == BrakeState(True, at(-3600))
        assert brake(30, 40, LIMITS, stepped.engaged_since, at(-3600 + 120)).engaged is False

    def test_a_database_outage_and_recovery(self) -> None:
        """Leases expire by the hundred during an outage; the brake holds every pass until
        the workers heartbeat again at 90 s, and the event is forgotten once they have."""
        since = None
        engaged = []
        # (seconds, stale, running): an outage makes 100 of 120 running jobs stale at once.
        for seconds, stale, running in [(0, 100, 120), (30, 100, 120), (60, 110, 120),
                                        (90, 3, 120), (120, 3, 120)]:
            state = brake(stale, running, LIMITS, since, at(seconds))
            since = state.engaged_since
            engaged.append(state.engaged)
        assert engaged == [True, True, True, False, False]
        assert since is None

    def test_a_mass_death_is_decided_after_one_hold(self) -> None:
        """Workers really died: braked for 120 s, then decided pass after pass until cleared."""
        since = None
        timeline = []
        for seconds, stale in [(0, 100), (60, 100), (120, 100), (150, 60), (180, 10)]:
            state = brake(stale, 120, LIMITS, since, at(seconds))
            since = state.engaged_since
            timeline.append((state.engaged, since is not None))
        assert timeline == [(True, True), (True, True), (False, True), (False, True),
                            (False, False)]


class TestBoundedCount:
    """A count of stale jobs stopped at count_limit gives the same answer as a full count."""

    def test_limit_values(self) -> None:
        """Half of 1000 running jobs is 500; with few running jobs, min_jobs bounds it."""
        assert count_limit(1000, LIMITS) == 500
        assert count_limit(1001, LIMITS) == 501
        assert count_limit(10, LIMITS) == 20
        assert count_limit(0, LIMITS) == 20

    @given(st.integers(min_value=0, max_value=100_000), st.integers(min_value=0, max_value=100_000),
           st.integers(min_value=1, max_value=500), st.floats(min_value=0.001, max_value=1.0))
    def test_bounded_count_decides_like_a_full_one(self, stale: int, running: int,
                                                   min_jobs: int, fraction: float) -> None:
        """over_limits(min(stale, count_limit)) == over_limits(stale), for any counts."""
        limits = BrakeLimits(min_jobs, fraction, 120.0)
        bounded = min(stale, count_limit(running, limits))
        assert over_limits(bounded, running, limits) == over_limits(stale, running, limits)


class TestBrakedDecisions:
    """A braked pass records every action as a skip mass_staleness_brake; skips stay."""

    def test_actions_become_brake_skips_and_skips_keep_their_reasons(self) -> None:
        """Resumes and terminalizations change nothing; held or live jobs keep their reason."""
        decided = (
            Decision(1, Disposition.RESUME, Reason.RESUMED_FROM_UNSTARTED_STEP, 0, 14),
            Decision(2, Disposition.TERMINALIZE, Reason.WORKER_DIED_MID_STEP, None, 10),
            Decision(3, Disposition.SKIP, Reason.OPERATOR_HOLD, None, 1),
            Decision(4, Disposition.TERMINALIZE, Reason.COMPLETION_RECOVERED, None, 7),
        )
        assert apply_brake(decided) == (
            Decision(1, Disposition.SKIP, Reason.MASS_STALENESS_BRAKE),
            Decision(2, Disposition.SKIP, Reason.MASS_STALENESS_BRAKE),
            Decision(3, Disposition.SKIP, Reason.OPERATOR_HOLD, None, 1),
            Decision(4, Disposition.SKIP, Reason.MASS_STALENESS_BRAKE),
        )

    def test_a_braked_decision_changes_no_status(self) -> None:
        """A brake skip carries no resume step and leads to no new status."""
        braked = apply_brake([Decision(9, Disposition.RESUME,
                                       Reason.RESUMED_IDEMPOTENT_STEP, 2, 13)])
        assert (braked[0].resume_step_index, braked[0].status_after) == (None, None)
