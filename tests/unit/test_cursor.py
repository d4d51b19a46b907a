"""Where the next pass's scans continue (``passes.next_cursor``), as a pure function."""

from __future__ import annotations

from reconciler.core.decisions import Thresholds
from reconciler.core.passes import PassConfig, next_cursor
from reconciler.core.ports import Candidate, Cursor, Fence

CONFIG = PassConfig(batch_size=3, thresholds=Thresholds(60.0, 3600.0), instance="unit")


def row(job_id: int, position: Cursor) -> Candidate:
    """A candidate with nothing but its place in its scan."""
    return Candidate(job_id, "report", Fence(1), 1, 3, False, position.wedged is not None,
                     None, None, None, (), position=position)


def expired(job_id: int) -> Candidate:
    return row(job_id, Cursor((f"t{job_id}", job_id)))


def wedged(job_id: int) -> Candidate:
    return row(job_id, Cursor((f"t{job_id}", job_id)).in_wedged_scan())


def test_a_short_batch_ends_the_sweep() -> None:
    """Fewer rows than the batch: both scans were read through, the next starts over."""
    assert next_cursor([expired(1), wedged(2)], CONFIG) is None
    assert next_cursor([], CONFIG) is None


def test_a_full_batch_of_expired_leases_continues_that_scan_only() -> None:
    assert next_cursor([expired(1), expired(2), expired(3)], CONFIG) == Cursor(("t3", 3))


def test_a_batch_topped_up_by_wedged_jobs_continues_both_scans() -> None:
    """The expired scan continues after its last row (later expiries sort after it) and
    the wedged scan after its own, so skipped wedged jobs cannot starve the rest."""
    assert next_cursor([expired(1), wedged(7), wedged(9)], CONFIG) == Cursor(
        ("t1", 1), ("t9", 9))
    assert next_cursor([wedged(4), wedged(5), wedged(6)], CONFIG) == Cursor(None, ("t6", 6))
