"""What an operator can do to one job of the configured source, as a port: the four
actions of hold, unhold, retry and cancel, each fenced and recorded by whoever implements
it, and the bulk form's choice of jobs. The command line and the console hold it by this
port; the composition root builds it over the configured source."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, TypedDict, Unpack

from reconciler.core.vocabulary import ActionOutcome, OperatorAction

BULK_CHUNK = 500
"""Jobs per chunk of a bulk action (``act_on_chunk``): about a pass's batch."""

ActionCounter = Callable[[OperatorAction, str, ActionOutcome], None]
"""Counts one action by (action, source, outcome): the operator actions metric."""


def not_counted(action: OperatorAction, source: str, outcome: ActionOutcome) -> None:
    """The counter of a desk whose process exposes no metrics."""


@dataclass(frozen=True, slots=True)
class ActionReport:
    """What one action did to one job."""

    action: OperatorAction
    job_id: str
    """The job's key as its source spells it."""
    applied: bool
    refusal: str | None
    """A short code when refused (``fence_lost``, ``not_held``, ``already_ended``, ...)."""
    line: str
    """One line for people: what happened, and what the system cannot do (a foreign
    system's workers are not stopped by a hold, say)."""


class BulkFilter(TypedDict, total=False):
    """What a bulk action acts on, the console's and the command line's alike: the jobs
    whose latest real decision has this reason and this disposition, whose recorded kind
    matches the glob, made since ``since`` and no later than ``until``. A filter left out
    (or None) matches any."""

    reason: str | None
    disposition: str | None
    kind: str | None
    since: datetime | None
    until: datetime | None


class OperatorDesk(Protocol):
    """The operator actions on the configured source."""

    source: str
    """The source's name, as the audit spells it."""

    def allowed(self, job_id: str) -> frozenset[OperatorAction]:
        """The actions the job's current state allows (empty for an unknown job)."""

    def act(self, action: OperatorAction, job_id: str, *, actor: str,
            note: str | None) -> ActionReport:
        """Apply one action, fenced on the job as read now, and record it either way."""

    def act_on_chunk(self, action: OperatorAction, job_ids: Sequence[str], *, actor: str,
                     note: str | None) -> list[ActionReport]:
        """``act`` on each of a chunk of jobs (about a pass's batch), in the order given:
        where the source can, in one transaction and a few statements, each job fenced
        inside them; the chunk applied and recorded whole, or not at all."""

    def bulk_targets(self, action: OperatorAction, *, limit: int,
                     **filters: Unpack[BulkFilter]) -> list[str]:
        """The jobs whose latest decision matches ``filters`` and whose state allows
        ``action`` now, newest decision first, at most ``limit``."""


def act_in_chunks(desk: OperatorDesk, action: OperatorAction, job_ids: Sequence[str], *,
                  actor: str, note: str | None) -> Iterator[list[ActionReport]]:
    """``action`` on every one of ``job_ids``, a chunk (``BULK_CHUNK``) at a time through
    the desk's ``act_on_chunk``; each chunk's reports as it is done (a bulk's progress)."""
    for start in range(0, len(job_ids), BULK_CHUNK):
        yield desk.act_on_chunk(action, job_ids[start:start + BULK_CHUNK], actor=actor,
                                note=note)
