"""Set-wise swaps: a pass's changes grouped into batches, each swapped in by one statement
over the batch's fence snapshots.

A foreign source repeats every row's fence (the snapshot its decision was read with and the
rule's time predicate) in that statement; a row whose fence no longer holds is simply not
returned, and the pass records it as ``fence_lost``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from reconciler.core.ports import PlannedChange
from reconciler.core.vocabulary import Disposition
from reconciler.sources.kit.shapes import is_wedged, reason_text


@dataclass(frozen=True, slots=True)
class Batch:
    """Changes swapped in by one statement: the same disposition and reason code, under
    the same rule (``wedged_after_seconds``: the wedged rule's time predicate; None: the
    expired rule's, each row's own lease)."""

    disposition: Disposition
    reason: str
    wedged_after_seconds: float | None
    changes: tuple[PlannedChange, ...]


def batches(changes: Sequence[PlannedChange]) -> list[Batch]:
    """The changes grouped into batches, in their order of first appearance (few: the
    dispositions, reasons and kinds' thresholds of one pass)."""
    grouped: dict[tuple[Disposition, str, float | None], list[PlannedChange]] = {}
    for change in changes:
        wedged = change.thresholds.wedged_after_seconds if is_wedged(change) else None
        key = (change.decision.disposition, reason_text(change), wedged)
        grouped.setdefault(key, []).append(change)
    return [Batch(*key, tuple(group)) for key, group in grouped.items()]

