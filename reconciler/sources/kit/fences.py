"""The step ledger around a foreign swap: read (and locked) before it, fenced after it.

A job whose task records its steps in the ledger carries its last write in its fence
snapshot; the swap leaves it out when a step was recorded since, and moves the ledger of
each job it changed past the attempt just ended, so that attempt's late writes record
nothing. Both are one statement per batch on PostgreSQL, written by the ledger's own store
(``storage.step_ledger.PassLedger``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime

from reconciler.core.ports import Candidate, Fence, FenceSnapshot


@dataclass(frozen=True, slots=True)
class LedgerMark:
    """A job's step ledger as its decision read it: the newest write (None: no records)."""

    last_write: datetime | None


@dataclass(frozen=True, slots=True)
class ForeignFence(FenceSnapshot):
    """The base of a foreign source's fence snapshot. ``ledger``: the step ledger as read,
    which the swap checks is unchanged (None: the source's steps are not in the ledger)."""

    ledger: LedgerMark | None = field(default=None, kw_only=True)

def with_ledger(candidate: Candidate, mark: LedgerMark) -> Candidate:
    """The candidate with the ledger as read composed into its fence snapshot."""
    fence = candidate.fence
    snapshot = fence.snapshot
    if not isinstance(snapshot, ForeignFence):  # pragma: no cover - every foreign source's
        raise TypeError(f"{type(snapshot).__name__} is not a foreign fence")
    return dataclasses.replace(candidate, fence=Fence(
        fence.generation, dataclasses.replace(snapshot, ledger=mark)))
