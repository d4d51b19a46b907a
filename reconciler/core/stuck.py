"""Stuck work: running jobs past their threshold that the last pass did not act on, by
what held them back (the stale-claim gauges). Pure: counts in, counts out.

Two views meet here. A source counts what it can see in its own rows (expired leases, its
holds and gates, rows it cannot judge, owners whose liveness is unknown); a pass knows why
it skipped the expired jobs it read (the brake, an unreadable job, a gate the source keeps
no mark of). The pass's reasons fill in what the source cannot see, moved out of the
source's ``awaiting_decision`` count, never added on top of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from reconciler.core.ports import PlannedChange, StuckCount, StuckWork
from reconciler.core.vocabulary import Disposition, Reason, StuckReason

HELD_BY_THE_PASS: dict[Reason, StuckReason] = {
    Reason.MASS_STALENESS_BRAKE: StuckReason.MASS_STALENESS_BRAKE,
    Reason.OPERATOR_HOLD: StuckReason.OPERATOR_HOLD,
    Reason.WAITING_ON_GATE: StuckReason.WAITING_ON_GATE,
    Reason.RECONCILE_ERROR: StuckReason.RECONCILE_ERROR,
}
"""The skips that leave an expired job stuck, and the gauges' reason each one counts as."""


def held_back(planned: Sequence[PlannedChange]) -> StuckWork:
    """The jobs a pass read and held back, by reason, each reason's oldest expiry as its
    evidence recorded it."""
    held: StuckWork = {}
    for change in planned:
        d = change.decision
        reason = HELD_BY_THE_PASS.get(d.reason) if d.disposition is Disposition.SKIP else None
        if reason is None:
            continue
        age = change.evidence.get("lease_expired_seconds")
        held[reason] = _plus(held.get(reason), StuckCount(
            1, float(age) if isinstance(age, int | float) else None))
    return held


def merged(parts: Iterable[StuckWork]) -> StuckWork:
    """Several passes' (a tick's batches') held-back counts as one."""
    total: StuckWork = {}
    for part in parts:
        for reason, count in part.items():
            total[reason] = _plus(total.get(reason), count)
    return total


def stuck_work(source: StuckWork, held: StuckWork) -> StuckWork:
    """Every reason's count for the gauges: the source's own, with the jobs the last pass
    held back for a reason the source does not count itself moved out of its
    ``awaiting_decision`` (at most as many as it has: the source's count is the newer)."""
    result = {reason: source.get(reason, StuckCount(0)) for reason in StuckReason}
    waiting = result[StuckReason.AWAITING_DECISION]
    for reason, count in held.items():
        if reason in source:
            continue
        moved = min(count.count, waiting.count)
        if moved:
            result[reason] = StuckCount(moved, count.oldest_seconds)
            waiting = StuckCount(waiting.count - moved, waiting.oldest_seconds)
    result[StuckReason.AWAITING_DECISION] = (waiting if waiting.count
                                             else StuckCount(0))
    return result


def no_live_workers(work: StuckWork, running: int) -> bool:
    """Whether none of the source's ``running`` jobs has a live owner: there are some, and
    every one is past its threshold (its owner silent or gone, its lease run out, whatever
    held it back since). While the owners' liveness is unknown this says nothing (False):
    ``reconciler_liveness_unknown`` says why instead."""
    if running <= 0 or work.get(StuckReason.LIVENESS_UNKNOWN, StuckCount(0)).count:
        return False
    past = sum(count.count for count in work.values())
    return past >= running


def _plus(a: StuckCount | None, b: StuckCount) -> StuckCount:
    if a is None:
        return b
    ages = [x for x in (a.oldest_seconds, b.oldest_seconds) if x is not None]
    return StuckCount(a.count + b.count, max(ages) if ages else None)
