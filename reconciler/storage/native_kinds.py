"""The ``native`` source under a config file's ``[kinds]`` tables (docs/sources.md).

Without ``[kinds]`` the native source's prebuilt scans serve every pass unchanged. With
them, two things change where the source scans, so neither fills a batch with jobs the
pass would only skip:

- kinds resolved to ``reconcile = false`` are left out of both scans (never touched) and
  out of the brake's counts (the pass could not act on them);
- the wedged scan uses each running kind's own ``wedged_after_seconds`` (one ``CASE`` over
  the kinds running now, which are few), so a kind wedged sooner than the default is
  found and one wedged later is not picked up early.

Decisions are then made per kind by the pass (``PassConfig.thresholds_for``); the swap
already repeats each change's own thresholds.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.decisions import Thresholds
from reconciler.core.kinds import KindPolicy, KindRules
from reconciler.core.ports import Candidate, Cursor, JobSource, StuckWork
from reconciler.storage.clock import db_now, now_plus
from reconciler.storage.native_source import (
    NativeSource,
    brake_totals,
    evidence_columns,
)
from reconciler.storage.pass_store import SourceFactory, native_source
from reconciler.storage.sql import (
    ACTIVITY_INDEX,
    EXPIRY_INDEX,
    IN_PROCESSING,
    SCANNED,
    along,
    for_update,
    jobs,
    place_type,
)


class KindedNativeSource(NativeSource):
    """This project's own jobs, scanned under per-kind rules (see the module docstring)."""

    def __init__(self, conn: Connection, kinds: KindRules, *, lock: bool) -> None:
        super().__init__(conn, lock=lock)
        self.kinds = kinds
        self.lock = lock
        self._reconciled: dict[str, KindPolicy] | None = None

    def _policies(self) -> dict[str, KindPolicy]:
        """The reconciled kinds among the processing jobs, with their policies: read once
        per transaction (the scans and the brake's counts all filter by them)."""
        if self._reconciled is None:
            running = self.conn.execute(
                sa.select(jobs.c.job_kind).where(IN_PROCESSING).distinct()).scalars()
            policies = {kind: self.kinds.resolve(kind) for kind in running}
            self._reconciled = {kind: p for kind, p in policies.items() if p.reconcile}
        return self._reconciled

    def candidates(self, limit: int, thresholds: Thresholds, after: Cursor | None
                   ) -> list[Candidate]:
        """Expired leases of reconciled kinds first (paged by key), then live leases idle
        past their own kind's wedged time, within ``limit``."""
        policies = self._policies()
        if not policies or limit <= 0:
            return []
        reconciled = jobs.c.job_kind.in_(sorted(policies))
        expired = along(sa.select(*evidence_columns(self.dialect), *brake_totals(reconciled))
                        .where(SCANNED, reconciled, jobs.c.lease_expires_at <= db_now())
                        .order_by(jobs.c.lease_expires_at, jobs.c.job_id).limit(limit),
                        EXPIRY_INDEX)
        if after is not None and after.position is not None:
            expired = expired.where(_after(self.dialect, jobs.c.lease_expires_at, after.position))
        rows: list[Any] = list(self.conn.execute(
            for_update(self.dialect, expired, lock=self.lock)).all())
        self.counted(rows)
        if len(rows) < limit:
            wedged_after = sa.case(
                {kind: sa.literal(-p.thresholds.wedged_after_seconds, sa.Float())
                 for kind, p in policies.items()},
                value=jobs.c.job_kind)
            wedged = along(sa.select(*evidence_columns(self.dialect))
                           .where(SCANNED, reconciled,
                                  jobs.c.last_activity_at <= now_plus(wedged_after),
                                  jobs.c.lease_expires_at > db_now())
                           .order_by(jobs.c.last_activity_at, jobs.c.job_id)
                           .limit(limit - len(rows)), ACTIVITY_INDEX)
            if after is not None and after.wedged is not None:
                wedged = wedged.where(_after(self.dialect, jobs.c.last_activity_at, after.wedged))
            rows += self.conn.execute(for_update(self.dialect, wedged, lock=self.lock)).all()
        return self._with_steps(rows)

    def stuck_work(self, *kinds: Any) -> StuckWork:
        """As the native source's, of reconciled kinds only (the others are never touched,
        so never stuck for the reconciler)."""
        policies = self._policies()
        if not policies:
            return {}
        return super().stuck_work(jobs.c.job_kind.in_(sorted(policies)), *kinds)

    def running_count(self) -> int:
        """Processing jobs of reconciled kinds: the brake weighs only jobs a pass could act
        on (``core.brake.brake``), as the foreign sources count them; as the expired scan
        counted them, when it found any."""
        if self._brake_counts is not None:
            return self._brake_counts[0]
        policies = self._policies()
        if not policies:
            return 0
        return int(self.conn.execute(
            sa.select(sa.func.count())
            .where(IN_PROCESSING, jobs.c.job_kind.in_(sorted(policies)))).scalar_one())

    def stale_count(self, limit: int) -> int:
        """Expired, unheld processing jobs of reconciled kinds, up to ``limit``; as the
        expired scan counted them, when it found any."""
        if self._brake_counts is not None:
            return min(self._brake_counts[1], limit)
        policies = self._policies()
        if not policies:
            return 0
        stale = sa.select(jobs.c.job_id).where(
            SCANNED, jobs.c.job_kind.in_(sorted(policies)), jobs.c.lease_expires_at <= db_now(),
            jobs.c.operator_hold.is_(False)).limit(limit).subquery()
        return int(self.conn.execute(sa.select(sa.func.count()).select_from(stale))
                   .scalar_one())


def _after(dialect: str, time_column: Any, place: tuple[Any, ...]) -> Any:
    """Rows after a cursor's (time, job id) in a scan ordered by ``time_column``, job id."""
    at, job_id = place
    return (sa.tuple_(time_column, jobs.c.job_id)
            > sa.tuple_(sa.literal(at, place_type(dialect)),
                        sa.literal(job_id, sa.BigInteger())))


def kinded_native(kinds: KindRules) -> SourceFactory:
    """A source factory for the native source under ``kinds``; the plain native source
    (its prebuilt scans) when no table could change what a scan finds."""
    if not any(r.reconcile is False or r.wedged_after_seconds is not None
               for r in kinds.rules):
        return native_source

    def build(conn: Connection, lock: bool) -> JobSource:
        return KindedNativeSource(conn, kinds, lock=lock)

    return build


def open_native(connection: Connection, config: object, kinds: KindRules, *,
                lock: bool) -> JobSource:
    """The native source as the source registry opens a source: on a pass's connection,
    under ``[kinds]`` (its ``[source]`` table has no keys, so ``config`` adds nothing)."""
    return kinded_native(kinds)(connection, lock)
