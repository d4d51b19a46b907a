"""The wedged rule's SQL for one transaction: a live job whose activity stopped.

A job is wedged when its owner still answers but its activity (the system's own column
where it keeps one, else the job's step-ledger records) has stopped for its kind's
``wedged_after_seconds``. Without such records no job of a system that keeps no activity
can be wedged, so its wedged scan, a read of every running job, is skipped; and a
liveness that loads only the expired jobs loads, beside them, only the live jobs whose
ledger went silent (``silent_keys``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from reconciler.core.kinds import KindPolicy
from reconciler.sources.kit.shapes import AllKinds, Shape, by_kind
from reconciler.sources.kit.system import Silent
from reconciler.storage.clock import now_plus, seconds_since
from reconciler.storage.step_ledger import PassLedger


class WedgedRule:
    """The rule for one system's shape and one transaction's step ledger."""

    def __init__(self, shape: Shape, ledger: PassLedger) -> None:
        self._shape = shape
        self._ledger = ledger

    def may_apply(self, policies: Mapping[str, KindPolicy]) -> bool:
        """Whether any job may be wedged: always where the system keeps its own activity,
        else where some job's ledger records are older than the shortest
        ``wedged_after_seconds`` running."""
        if self._shape.activity is not None:
            return True
        return self._ledger.written_before(_shortest(policies))

    def silent_keys(self, policies: Mapping[str, KindPolicy]) -> Silent:
        """Of some running jobs' keys, those whose ledger has been silent for the shortest
        ``wedged_after_seconds`` running (the live jobs the wedged scan may find)."""
        shortest = _shortest(policies)

        def silent(keys: Sequence[str]) -> set[str]:
            return self._ledger.silent_among(keys, shortest)

        return silent

    def stalled(self, policies: Mapping[str, KindPolicy]) -> sa.ColumnElement[bool]:
        """No activity for the kind's ``wedged_after_seconds``."""
        return self.silent_for(by_kind(self._shape.kind, policies,
                                       lambda p: p.thresholds.wedged_after_seconds))

    def still_stalled(self, seconds: float) -> sa.ColumnElement[bool]:
        """The rule's time predicate (no activity for ``seconds``), repeated in a swap."""
        return self.silent_for(sa.literal(seconds, sa.Float()))

    def silent_for(self, seconds: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
        """No activity (the system's own, else the ledger's newest write) for ``seconds``."""
        activity = self._shape.activity
        if activity is not None:
            return sa.func.coalesce(seconds_since(activity) >= seconds, False)
        last = self._ledger.last_write(sa.cast(self._shape.key, sa.String()))
        return last < now_plus(-seconds)


def _shortest(policies: Mapping[str, KindPolicy]) -> float:
    return min(p.thresholds.wedged_after_seconds for p in (
        [policies.alike] if isinstance(policies, AllKinds) else policies.values()))
