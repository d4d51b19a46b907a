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
                          counted: bool = True, lost_to_system: bool = False) -> int:
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

    ``lost_to_system``: the system's own recovery took back an attempt from a worker that
    never ended it (pg-boss's expiry says so in the job's output), and none of its later
    attempts ended but by the reconciler's resumes (each of which leaves that record as it
    was): the first gap in the chain is that attempt, counted lost once, and the count goes
    on before it.
    """
    count, later, system = 1, attempt, lost_to_system and counted
    pending = list(resumes)
    while True:
        if pending and _is_the_attempt_before(pending[0][1], later, counted):
            if not _lost(pending[0][0]):
                break  # ended by the reconciler otherwise: the count stops
            count, later = count + 1, pending.pop(0)[1]
            continue
        if system and later > 1:
            count, later, system = count + 1, later - 1, False
            continue
        break
    return count


def _is_the_attempt_before(used: Any, later: int, counted: bool) -> bool:
    """Whether a resume's recorded ``attempts_used`` is the attempt right before ``later``."""
    return (not isinstance(used, bool) and isinstance(used, int)
            and used == (later - 1 if counted else later))


def _lost(reason: str) -> bool:
    """Whether a resume with this reason ended a lost attempt (an unknown code: no)."""
    try:
        return reclaimed_attempt_outcome(Reason(reason)) is AttemptOutcome.LOST
    except ValueError:
        return False


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
                c.attempt_count, history.get(str(c.job_id), ()), counted=counted,
                lost_to_system=c.lost_to_system))
            for c in found]
