"""The mass-staleness brake (docs/operating.md): pure, with the database's time passed in.

When one pass finds at least ``min_jobs`` stale jobs and they are at least
``stale_fraction`` of the running jobs, a database failover, a network partition or a clock
step is more likely than that many workers dying at once: the workers may be alive and
about to heartbeat again. The pass then changes none of them (``apply_brake``) for
``hold_seconds`` from the first braked pass. Jobs still stale after that are decided by
the rules, and the brake stays released until the stale count falls back under the limits,
so a real mass death costs one hold, not a brake that never lets go.

The pass keeps ``engaged_since`` where every replica reads the same value (the database),
and passes the database's ``now``: a replica's own clock never decides.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from reconciler.core.decisions import Decision
from reconciler.core.vocabulary import Disposition, Reason


@dataclass(frozen=True, slots=True)
class BrakeLimits:
    """When the brake engages and for how long; built by ``Settings.brake_limits()``."""

    min_jobs: int
    stale_fraction: float
    hold_seconds: float

    def __post_init__(self) -> None:
        if self.min_jobs < 1:
            raise ValueError("brake min_jobs must be at least 1")
        if not 0 < self.stale_fraction <= 1:
            raise ValueError("brake stale_fraction must be above 0 and at most 1")
        if not self.hold_seconds >= 0:  # also refuses NaN
            raise ValueError("brake hold_seconds must be 0 or more")


@dataclass(frozen=True, slots=True)
class BrakeState:
    """The brake after one pass: engaged or not, and since when this staleness event began.

    ``engaged_since`` is the database time of the first braked pass of the current event,
    kept while the stale count stays over the limits (engaged, then released after the
    hold) and None once it falls under them. Store it and pass it to the next pass.
    """

    engaged: bool
    engaged_since: datetime | None


def over_limits(stale_jobs: int, running_jobs: int, limits: BrakeLimits) -> bool:
    """True when ``stale_jobs`` is at least ``min_jobs`` and ``stale_fraction`` of running."""
    if stale_jobs < 0 or running_jobs < 0:
        raise ValueError("job counts cannot be negative")
    # The two counts are read at slightly different instants; stale jobs are running jobs,
    # so the running count is never taken as lower than the stale count.
    running = max(running_jobs, stale_jobs)
    return stale_jobs >= limits.min_jobs and stale_jobs >= limits.stale_fraction * running


def brake(stale_jobs: int, running_jobs: int, limits: BrakeLimits,
          engaged_since: datetime | None, now: datetime) -> BrakeState:
    """Whether this pass is braked, and the ``engaged_since`` to keep for the next pass.

    ``stale_jobs``: processing jobs the pass would act on that went stale (expired lease or
    gone session), not counting held jobs or jobs waiting on a gate, which are stale on
    purpose. Count them beyond the batch (a batch capped at ``batch_size`` would make a
    large fleet never brake); ``count_limit`` says how far a bounded count must go.
    ``running_jobs``: every processing job the pass could act on, the stale ones
    included; jobs of kinds it never reconciles (``reconcile = false``) count in neither.
    ``now``: the database's time, like ``engaged_since``.

    A ``hold_seconds`` of 0 never brakes. A clock stepped back to before ``engaged_since``
    restarts the hold at ``now`` rather than braking until the clock catches up.
    """
    if not over_limits(stale_jobs, running_jobs, limits):
        return BrakeState(engaged=False, engaged_since=None)
    if engaged_since is None or now < engaged_since:
        engaged_since = now
    held_seconds = (now - engaged_since).total_seconds()
    return BrakeState(engaged=held_seconds < limits.hold_seconds, engaged_since=engaged_since)


def count_limit(running_jobs: int, limits: BrakeLimits) -> int:
    """How many stale jobs a bounded count needs to reach to decide ``over_limits``.

    Counting stale jobs with ``LIMIT count_limit(...)`` costs at most that many index
    entries, however large the backlog, and gives ``brake`` the same answer as a full count.
    """
    if running_jobs < 0:
        raise ValueError("job counts cannot be negative")
    return max(limits.min_jobs, math.ceil(limits.stale_fraction * running_jobs))


def apply_brake(decisions: Iterable[Decision]) -> tuple[Decision, ...]:
    """The decisions of a braked pass: each resume or terminalization becomes a skip
    ``mass_staleness_brake`` that changes nothing; skips keep their own reasons."""
    return tuple(
        d if d.disposition is Disposition.SKIP
        else Decision(d.job_id, Disposition.SKIP, Reason.MASS_STALENESS_BRAKE)
        for d in decisions
    )
