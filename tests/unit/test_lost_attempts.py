"""A foreign job's attempts lost in a row, read from the reconciler's own resumes of it."""

from __future__ import annotations

from typing import Any

import pytest

from reconciler.core.vocabulary import Reason
from reconciler.sources.kit.history import lost_in_a_row_resumed

IDEM = Reason.RESUMED_IDEMPOTENT_STEP.value
UNSTARTED = Reason.RESUMED_FROM_UNSTARTED_STEP.value


@pytest.mark.parametrize(("attempt", "resumes", "expected"), [
    (1, [(IDEM, 1)], 1),  # the same count again: a job id used anew, another job's past
    (1, [], 1),  # the attempt judged counts: its worker is gone
    (3, [(IDEM, 2), (UNSTARTED, 1)], 3),  # each resume the attempt before the next
    (4, [(IDEM, 2), (IDEM, 1)], 1),  # attempt 3 ended by its own worker: the count stops
    (1, [(IDEM, 3)], 1),  # the counter went back: an operator's retry starts afresh
    (3, [(IDEM, 2), (Reason.WORKER_WEDGED.value, 1)], 2),  # not a lost attempt
    (3, [(IDEM, None), (IDEM, 1)], 1),  # no attempts recorded: nothing to chain on
    (3, [("no_such_reason", 2)], 1),
])
def test_consecutive_lost_attempts(attempt: int, resumes: list[tuple[str, Any]],
                                   expected: int) -> None:
    """Newest first, counted while each resume ended the attempt just before the next."""
    assert lost_in_a_row_resumed(attempt, resumes) == expected


def test_a_system_that_counts_no_attempts_counts_each_resume() -> None:
    """Its counter never moves (a table without ``attempts_column``): every resume counts,
    while each one ended a lost attempt."""
    resumes = [(IDEM, 1), (UNSTARTED, 1), (Reason.WORKER_WEDGED.value, 1), (IDEM, 1)]
    assert lost_in_a_row_resumed(1, resumes, counted=False) == 3


@pytest.mark.parametrize(("attempt", "resumes", "expected"), [
    (2, [], 2),  # attempt 1 taken back by the system: it and this one
    (3, [(IDEM, 2)], 3),  # ours after the system's: 3, 2 (ours), then 1 (the system's)
    (3, [(IDEM, 1)], 3),  # the system's after ours: 3, 2 (the system's), then 1 (ours)
    (4, [(IDEM, 3), (IDEM, 1)], 4),  # the one gap is the system's, once
    (4, [(IDEM, 1)], 2),  # two gaps: the system's record names only its latest
    (3, [(Reason.WORKER_WEDGED.value, 2)], 1),  # attempt 2 ended by us otherwise
    (1, [], 1),  # no attempt before the first to have been taken back
])
def test_an_attempt_the_system_took_back_is_counted_once(
        attempt: int, resumes: list[tuple[str, Any]], expected: int) -> None:
    """``lost_to_system`` (pg-boss's expiry wrote so): the first gap in the chain of the
    reconciler's own resumes is the attempt the system took back from a dead worker."""
    assert lost_in_a_row_resumed(attempt, resumes, lost_to_system=True) == expected
