"""The one kit class: a declared system bound to one transaction, as the pass's port.

A system declares, in SQL, what a running job of it is, which of them lost their owner or
outlived their lease, and how a batch of changes is swapped in through its own shapes
(``kit.system.System``); ``DeclaredSource`` pages, locks, reads the step ledger once per
batch, builds the candidates and counts for the brake, calling those declared functions
with what they need and never called back by them. Per-kind values
(``max_run_seconds``, ``wedged_after_seconds``) enter the SQL as one ``CASE`` over the
kinds actually running, which are few.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.decisions import Thresholds
from reconciler.core.kinds import KindPolicy, KindRules
from reconciler.core.ports import (
    Candidate,
    Cursor,
    JobKey,
    LivenessUnknown,
    PlannedChange,
    StuckCount,
    StuckWork,
    Unjudged,
)
from reconciler.core.vocabulary import JobStatus, StuckReason
from reconciler.sources.kit.batches import batches, fence_of
from reconciler.sources.kit.fences import ForeignFence, LedgerMark, with_ledger
from reconciler.sources.kit.history import with_lost_attempts
from reconciler.sources.kit.scan import brake_counts, expired_scan, held_by_key
from reconciler.sources.kit.shapes import AllKinds, acting
from reconciler.sources.kit.system import (
    NOT_LOADED,
    Changed,
    Loaded,
    Scope,
    Silent,
    System,
    Wanted,
)
from reconciler.sources.kit.transaction import SourceTransaction
from reconciler.sources.kit.wedged import WedgedRule
from reconciler.storage.operator_record import not_held
from reconciler.storage.sql import MYSQL, POSTGRESQL


class DeclaredSource:
    """A declared foreign system bound to one connection (the pass's transaction, or an
    operator's read) and the kinds' rules: the ``JobSource`` port, and what operators
    see of the system."""

    def __init__(self, name: str, system: System, connection: Connection, kinds: KindRules,
                 *, lock: bool = True) -> None:
        self.source_name = name
        self.system = system
        self._conn = connection
        self._kinds = kinds
        self._lock = lock
        # What the transaction reads and owes is kept apart from the declaration, in one
        # object made for it (the declaration is bound anew per transaction).
        self._tx = SourceTransaction(connection, name)
        self._wedged = WedgedRule(system.shape, self._tx.ledger)

    @property
    def connection(self) -> Connection:
        """The connection (the pass's transaction, or an operator's read) it is bound to."""
        return self._conn

    # -- what operators see ------------------------------------------------- #

    def check_schema(self) -> None:
        """Raise one ``ConfigError`` line when the system's tables or functions (or its
        liveness's outside end) are missing."""
        self.system.check_schema(self._conn)
        if self.system.liveness is not None:
            self.system.liveness.check()

    def listing(self, wanted: Wanted | None = None) -> sa.Select[Any]:
        """The system's jobs, for operators (``reconciler jobs list|show``): every one, or
        at least what ``wanted`` names where the system narrows its listing itself (the
        caller still filters, orders and limits)."""
        if wanted is not None and self.system.listing_for is not None:
            return self.system.listing_for(self._conn, wanted)
        return self.system.listing(self._conn)

    def status_words(self) -> Mapping[str, JobStatus]:
        """The system's statuses (``source_status``) in this project's words."""
        return self.system.status_words

    def listing_order(self, jobs: sa.Subquery) -> list[sa.ColumnElement[Any]]:
        """The order of ``jobs list`` over ``listing()`` as the subquery ``jobs``: the
        declared one, else newest first, by creation where the system keeps it, else by id
        (which grows with each new job in the systems that keep no creation time)."""
        if self.system.listing_order is not None:
            return self.system.listing_order(jobs)
        newest = jobs.c.created_at.desc()
        # MySQL has no NULLS LAST, and needs none: its NULLs sort first, so last descending.
        if self._conn.dialect.name != MYSQL:
            newest = newest.nulls_last()
        return [newest, jobs.c.job_id.desc()]

    def unjudged(self, job_id: JobKey | None = None) -> Unjudged | None:
        """Running jobs (``job_id``: only that one) whose rows lack what a pass reads, so
        that no pass can judge them; None where every running row is judged."""
        if self.system.unjudged is None:
            return None
        return self.system.unjudged(self._conn, job_id)

    # -- the port ------------------------------------------------------------ #

    def expire_gone_owners(self, timeout_seconds: float) -> int:
        """Nothing to declare: a foreign source judges its owners when it reads them."""
        return 0

    def candidates(self, limit: int, thresholds: Thresholds, after: Cursor | None
                   ) -> list[Candidate]:
        """Expired running jobs, then live ones whose recorded steps stopped moving for
        their kind's ``wedged_after_seconds``, each scan paged by id after the cursor's
        place in it; at most ``limit``.

        ``thresholds`` are the settings' values; each kind's own resolved thresholds (which
        default to them) are used instead.
        """
        policies = self._policies()
        if not policies or limit <= 0:
            return []
        key = self.system.shape.key
        # First: a declared liveness reads once what both scans need (the silent live
        # jobs too).
        wedge = self._wedged.may_apply(policies)
        if self._loaded(silent=self._wedged.silent_keys(policies) if wedge else None
                        ).rows == 0:
            return []  # the liveness loaded no running job: nothing to scan
        running = self._running(policies)
        expired = self._expired(policies)
        rows = self._held(self._conn.execute(expired_scan(
            running.where(self._reconciled(policies)), expired,
            self._order(), self.system.shape.locks, limit=limit,
            after=None if after is None or after.position is None else after.position[0],
            locking=self._lock and self._conn.dialect.name == POSTGRESQL,
            unheld=self._unheld)).all())
        if rows:  # the brake's counts, read with the candidates (``kit.scan``)
            self._tx.brake_counts = (int(rows[0].running_total) + self._loaded().counted,
                                     int(rows[0].expired_total))
        found = self._build(rows, policies, position=True)
        room = limit - len(found)
        if room > 0 and wedge:
            wedged_scan = (self._running(policies)
                           .where(self._reconciled(policies), sa.not_(expired),
                                  self._stalled(policies))
                           .order_by(self._order()).limit(room))
            if after is not None and after.wedged is not None:
                wedged_scan = wedged_scan.where(key > after.wedged[0])
            stalled = self._build(
                self._held(self._conn.execute(self._locked(wedged_scan)).all()),
                policies, position=True)
            found += [dataclasses.replace(c, position=c.position.in_wedged_scan())
                      for c in stalled if c.position is not None]
        return found

    def evidence_for(self, job_ids: Sequence[JobKey]) -> list[Candidate]:
        """The same facts for named running jobs, whatever their lease; no locks."""
        if not job_ids:
            return []
        policies = self._policies(reconciled_only=False)
        key = self.system.shape.key
        # Compared as text: an id from the command line names a job whatever the key's
        # type (a number, a UUID, a text key of digits), and this reads a handful of rows.
        named = sa.cast(key, sa.String()).in_([str(k) for k in job_ids])
        rows = self._conn.execute(self._running(policies, every=True).where(named)
                                  .order_by(key)).all()
        return self._build(rows, policies, position=False)

    def apply(self, changes: Sequence[PlannedChange]) -> dict[JobKey, int | None]:
        """Compare-and-swap the resumes and terminalizations, one set-wise swap per
        ``Batch`` (disposition, reason, rule); the jobs changed."""
        acting_changes = acting(changes)
        marks = [fence_of(change, ForeignFence).ledger for change in acting_changes]
        read = self._tx.ledger.newest_writes(sorted({
            str(change.decision.job_id)
            for change, mark in zip(acting_changes, marks, strict=True) if mark}))
        # A step recorded since the decision: it no longer holds, and the job is left out.
        holding = [change for change, ledger in zip(acting_changes, marks, strict=True)
                   if ledger is None
                   or read.get(str(change.decision.job_id)) == ledger.last_write]
        self._tx.brake_counts = None  # the brake's counts are of the jobs before these swaps
        changed: Changed = {}
        swapping = batches(holding, self._wedged.still_stalled, self._tx.ledger)
        if swapping:
            if self.system.shape.naive_utc is not None:
                self._tx.utc()
            wedged = any(b.stalled is not None for b in swapping)  # live jobs: loaded too
            scope = self._scope(judged=True, silent=self._wedged.silent_keys(
                self._policies()) if wedged else None)
            for batch in swapping:
                changed.update(self.system.swap(scope, batch))
        self._tx.ledger.fence_pending()
        if self.system.after_apply is not None:
            self.system.after_apply(self._conn, changed)
        return changed

    def park(self, skipped: Sequence[PlannedChange]) -> int:
        """None: a foreign system's tables have no column of ours to park a job in, so its
        held or gated jobs are rescanned (and, already recorded, not recorded again)."""
        return 0

    def stuck_work(self) -> StuckWork:
        """Running jobs of reconciled kinds whose owner is gone or whose lease ran out,
        awaiting a decision, and the oldest expiry age (a foreign system keeps no hold or
        gate of ours: the pass reports those it skipped)."""
        policies = self._policies()
        if not policies:
            return self._stuck_beside({})
        count, oldest = 0, None
        if self._loaded().rows != 0:  # else nothing to read
            expired = self._running(policies).where(self._reconciled(policies),
                                                    self._expired(policies)).subquery()
            count, oldest = self._conn.execute(sa.select(
                sa.func.count(), sa.func.max(expired.c.lease_expired_seconds))).one()
        return self._stuck_beside({StuckReason.AWAITING_DECISION: StuckCount(
            int(count), None if oldest is None else float(oldest))})

    def _stuck_beside(self, work: StuckWork) -> StuckWork:
        """The kit's count with what the declared liveness adds (the running jobs it
        cannot judge, by reason)."""
        liveness = self.system.liveness
        if liveness is None:
            return work
        return {**work, **liveness.stuck(self._scope(judged=True).verdict)}

    def liveness_unknown(self) -> LivenessUnknown | None:
        """Why the declared liveness's verdict was not trusted this transaction; None when
        it was, or where liveness is in the system's own tables, read with its jobs."""
        liveness = self.system.liveness
        return None if liveness is None else liveness.unknown(self._scope(judged=True).verdict)

    def leases_own(self) -> bool:
        """As the system's shape declares."""
        return self.system.shape.leases_own

    def kind_read(self, job_id: JobKey) -> str | None:
        """The kind of a job this transaction's scans read (None: none read)."""
        return self._tx.kinds_read.get(str(job_id))

    def running_kinds(self) -> list[str]:
        """The kinds of the running jobs, each once, sorted (whether reconciled or not)."""
        return sorted(k for k in self._conn.execute(
            sa.select(self._running({}, every=True).subquery().c.job_kind).distinct()
        ).scalars() if k is not None)

    def running_count(self) -> int:
        """Running jobs of reconciled kinds, as the scan that found this transaction's
        expired candidates counted them; else (no expired candidate: a pass of wedged
        ones only) counted now, the expired ones in the same read for ``stale_count``."""
        if self._tx.brake_counts is None:
            policies = self._policies()
            if not policies:
                return 0
            loaded = self._loaded()
            if loaded.rows == 0:  # nothing loaded to read: every live job counted
                self._tx.brake_counts = (loaded.counted, 0)
                return loaded.counted
            total, expired = self._conn.execute(brake_counts(
                self._running(policies).where(self._reconciled(policies)),
                self._expired(policies), self._unheld)).one()
            self._tx.brake_counts = (int(total) + self._loaded().counted, int(expired))
        return self._tx.brake_counts[0]

    def stale_count(self, limit: int) -> int:
        """Expired running jobs of reconciled kinds no operator holds, up to ``limit`` (as
        counted by the scan or ``running_count`` in this transaction, when they were)."""
        if self._tx.brake_counts is not None:
            return min(self._tx.brake_counts[1], limit)
        policies = self._policies()
        if not policies or self._loaded().rows == 0:
            return 0
        running = self._running(policies)
        stale = (running.where(self._reconciled(policies), self._expired(policies),
                               self._unheld(running.selected_columns.job_id))
                 .limit(limit).subquery())
        return int(self._conn.execute(sa.select(sa.func.count()).select_from(stale))
                   .scalar_one())

    # -- the declaration, called with what it needs -------------------------- #

    def _scope(self, *, judged: bool, every: bool = False, silent: Silent | None = None
               ) -> Scope:
        """What a declared function is given; ``judged``: with the declared liveness's
        verdict for this transaction, read the first time it is asked for (again the
        first time ``every`` running job, or the ``silent`` live ones, are asked for)."""
        liveness, tx = self.system.liveness, self._tx
        if judged and liveness is not None and (
                tx.verdict is None or (every and not tx.verdict_every)
                or (silent is not None and not (tx.verdict_every or tx.verdict_silent))):
            tx.verdict = liveness.judge(self._conn, self._kinds, every=every, silent=silent)
            tx.verdict_every = every or liveness.loaded(tx.verdict).every
            tx.verdict_silent = silent is not None
        return Scope(self._conn, self._tx.ledger, self._tx.history,
                     self._tx.verdict if judged else None)

    def _running(self, policies: Mapping[str, KindPolicy], *, every: bool = False
                 ) -> sa.Select[Any]:
        """Every running job (``every``: the live ones too, which a liveness may count)."""
        if self.system.shape.naive_utc == "scan":
            self._tx.utc()
        # Only a read of some kinds' jobs judges their liveness (not the list of kinds),
        # unless the verdict is what every read of its jobs reads.
        judged = bool(policies) or self.system.shape.judged_first
        return self.system.running(self._scope(judged=judged, every=every), policies)

    def _loaded(self, *, silent: Silent | None = None) -> Loaded:
        """What this transaction's verdict (read first where it is not yet) loaded and
        counted of the running jobs."""
        liveness = self.system.liveness
        if liveness is None:
            return NOT_LOADED
        return liveness.loaded(self._scope(judged=True, silent=silent).verdict)

    def _unheld(self, key: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
        """True where no operator holds the job: a held job is stale on purpose and the
        brake does not count it (``operator_holds``, probed by key, only for the expired
        rows a count reads)."""
        return not_held(self.source_name, key)

    def _expired(self, policies: Mapping[str, KindPolicy]) -> sa.ColumnElement[bool]:
        return self.system.expired(self._scope(judged=True), policies)

    def _policies(self, *, reconciled_only: bool = True) -> Mapping[str, KindPolicy]:
        """The policies of the kinds running now (few: task or queue names), read once per
        source (one pass's transaction); every kind unread (``AllKinds``) where the source
        allows it and ``[kinds]`` set the scans' keys alike for every kind."""
        if self.system.shape.scans_all_kinds and self.system.shape.kind_catalogue is None:
            every = AllKinds.of(self._kinds)
            if every is not None:
                return every if every.alike.reconcile or not reconciled_only else {}
        if self._tx.running_kinds is None:
            catalogue = self.system.shape.kind_catalogue
            if catalogue is None:
                catalogue = sa.select(self._running({}).subquery().c.job_kind).distinct()
            kinds = self._conn.execute(catalogue).scalars()
            self._tx.running_kinds = {kind: self._kinds.resolve(kind)
                                   for kind in kinds if kind is not None}
        return {kind: p for kind, p in self._tx.running_kinds.items()
                if p.reconcile or not reconciled_only}

    def _reconciled(self, policies: Mapping[str, KindPolicy]) -> sa.ColumnElement[bool]:
        if isinstance(policies, AllKinds):
            return sa.true()
        return self.system.shape.kind.in_(sorted(policies))

    def _stalled(self, policies: Mapping[str, KindPolicy]) -> sa.ColumnElement[bool]:
        """No activity (the job's own, else recorded steps) for the kind's
        ``wedged_after_seconds``, and whatever else the system's guard asks."""
        guard = self.system.wedge_guard
        return sa.and_(sa.true() if guard is None else guard(self._scope(judged=True),
                                                              policies),
                       self._wedged.stalled(policies))

    def _order(self) -> sa.ColumnElement[Any]:
        return self.system.shape.order(self._conn.dialect.name == POSTGRESQL)

    def _locked(self, query: sa.Select[Any]) -> sa.Select[Any]:
        if not self._lock or self._conn.dialect.name != POSTGRESQL:
            return query
        return query.with_for_update(skip_locked=True, of=self.system.shape.locks)

    def _held(self, rows: Sequence[sa.Row[Any]]) -> Sequence[sa.Row[Any]]:
        """The scanned rows this transaction holds (``kit.scan.held_by_key``)."""
        if not self._lock:
            return rows
        return held_by_key(self._conn, self.system.shape, rows)

    def _build(self, rows: Sequence[sa.Row[Any]], policies: Mapping[str, KindPolicy],
               *, position: bool) -> list[Candidate]:
        rows = [r for r in rows if r.job_kind in policies]
        self._tx.kinds_read.update((str(r.job_id), r.job_kind) for r in rows)
        shape, facts = self.system.shape, self.system.candidate
        scope = self._scope(judged=bool(rows))
        if not shape.steps_in_ledger:
            # Plans live in the system's own rows: no ledger read.
            return with_lost_attempts(self._tx.history, [
                facts(scope, r, policies[r.job_kind], None, position) for r in rows],
                counted=shape.counts_attempts)
        keys = [r.job_id for r in rows]
        steps, seen = self._tx.ledger.facts(keys)
        # The fence carries the job's last ledger write as read, so the swap repeats it.
        return with_lost_attempts(self._tx.history, [
            with_ledger(facts(scope, r, policies[r.job_kind], steps.get(str(r.job_id)),
                              position), LedgerMark(seen.get(str(r.job_id))))
            for r in rows], counted=shape.counts_attempts)
