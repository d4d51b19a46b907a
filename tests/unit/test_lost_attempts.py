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
