"""Lost attempts in a row for a foreign job: the crash-loop rule's count, from the audit.

A foreign system keeps no history of lost attempts, but the audit does: the attempts lost
in a row are read from the reconciler's own resumes of the job, one indexed read per batch
through the audit's store (``storage.audit.AuditHistory``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from reconciler.core.policy import reclaimed_attempt_outcome
from reconciler.core.ports import Candidate
from reconciler.core.vocabulary import AttemptOutcome, Reason
from reconciler.storage.audit import AuditHistory


def lost_in_a_row_resumed(attempt: int, resumes: Sequence[tuple[str, Any]], *,
                          counted: bool = True) -> int:
    """The crash-loop count of a foreign job in its ``attempt``-th attempt: this attempt
    (its worker is gone when the rule reads it), then each earlier attempt the reconciler
    took back from a dead worker and resumed, newest first (``resumes``: the reason and the
    recorded ``attempts_used`` of the job's applied resumes, newest first).

    As the native count, it stops at an attempt that ended any other way: a gap in the
    system's attempt counter (a run in between ended by its own worker, whose failure the
    system retried), a counter that went back (an operator's retry), a resume that did not
    end a lost attempt, the same count again (a job id used anew: its history is another
    job's). A terminalization is never counted: only someone's retry runs the job again
    after one, and a retry starts the count afresh. ``counted=False``: the system counts no
    attempts (a table without ``attempts_column``), its counter never moves, and each resume
    is counted, which is all the history it has.
    """
    count, later = 1, attempt
    for reason, used in resumes:
        try:
            lost = reclaimed_attempt_outcome(Reason(reason)) is AttemptOutcome.LOST
        except ValueError:
            break
        if not lost or isinstance(used, bool) or not isinstance(used, int) \
                or used != (later - 1 if counted else later):
            break
        count, later = count + 1, used
    return count


def with_lost_attempts(audit: AuditHistory, found: list[Candidate], *,
                       counted: bool = True) -> list[Candidate]:
    """The candidates with ``lost_attempts_in_a_row`` counted from the audit: the applied
    (not shadow) resumes of each job under this source, in one read for the batch
    (``counted``: whether the system counts attempts, see ``lost_in_a_row_resumed``)."""
    texts = sorted({str(c.job_id) for c in found})
    if not texts:
        return found
    history = audit.applied_resumes(texts)
    return [dataclasses.replace(c, lost_attempts_in_a_row=lost_in_a_row_resumed(
                c.attempt_count, history.get(str(c.job_id), ()), counted=counted))
            for c in found]
