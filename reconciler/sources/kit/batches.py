"""Set-wise swaps: a pass's changes grouped into batches, each swapped in by one statement
over the batch's fence snapshots.

A foreign source repeats every row's fence (the snapshot its decision was read with and the
rule's time predicate) in that statement; a row whose fence no longer holds is simply not
returned, and the pass records it as ``fence_lost``. A batch carries everything its swap
needs from the kit: the wedged rule's time predicate in SQL and the step ledger's port
to fence each job it changed, so a source's swap never calls the kit back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.ports import PlannedChange
from reconciler.core.vocabulary import Disposition
from reconciler.sources.kit.shapes import is_wedged, reason_text
from reconciler.storage.sql import POSTGRESQL
from reconciler.storage.step_ledger import PassLedger


@dataclass(frozen=True, slots=True)
class Batch:
    """Changes swapped in by one statement: the same disposition and reason code, under
    the same rule (``wedged_after_seconds``: the wedged rule's time predicate; None: the
    expired rule's, each row's own lease)."""

    disposition: Disposition
    reason: str
    wedged_after_seconds: float | None
    changes: tuple[PlannedChange, ...]
    stalled: sa.ColumnElement[bool] | None
    """The wedged rule's time predicate (no activity for ``wedged_after_seconds``), which
    the swap repeats; None under the expired rule, whose predicate is the source's own."""
    ledger: PassLedger
    """Where the swap fences the step ledger of each job it changed (``ledger.fence``)."""


def batches(changes: Sequence[PlannedChange],
            stalled: Callable[[float], sa.ColumnElement[bool]], ledger: PassLedger
            ) -> list[Batch]:
    """The changes grouped into batches, in their order of first appearance (few: the
    dispositions, reasons and kinds' thresholds of one pass); ``stalled`` gives the
    wedged rule's time predicate for a number of seconds."""
    grouped: dict[tuple[Disposition, str, float | None], list[PlannedChange]] = {}
    for change in changes:
        wedged = change.thresholds.wedged_after_seconds if is_wedged(change) else None
        key = (change.decision.disposition, reason_text(change), wedged)
        grouped.setdefault(key, []).append(change)
    return [Batch(*key, tuple(group), None if key[2] is None else stalled(key[2]), ledger)
            for key, group in grouped.items()]


SnapshotT = TypeVar("SnapshotT")


def fence_of(change: PlannedChange, kind: type[SnapshotT]) -> SnapshotT:
    """The change's fence snapshot, checked to be the source's own type ``kind`` (a
    decision carries back the snapshot its candidate was read with)."""
    snapshot = change.fence.snapshot
    if not isinstance(snapshot, kind):
        raise TypeError(f"job {change.decision.job_id}: a fence of "
                        f"{type(snapshot).__name__}, not {kind.__name__}")
    return snapshot



def swapped(conn: Connection, updates: Sequence[sa.Update], key: sa.ColumnElement[Any],
            keys: Sequence[str]) -> set[str]:
    """The keys (as text) of the rows a swap's fenced ``updates`` changed. PostgreSQL: the
    rows each returns (``RETURNING key``; one statement may cover a whole batch). Elsewhere
    one statement per change, ``keys`` in the same order, judged by its affected rows:
    MySQL has no ``UPDATE ... RETURNING``, and the row is the scan's, locked already."""
    if conn.dialect.name == POSTGRESQL:
        return {str(found) for update in updates
                for found in conn.execute(update.returning(key)).scalars()}
    return {job for job, update in zip(keys, updates, strict=True)
            if conn.execute(update).rowcount == 1}
