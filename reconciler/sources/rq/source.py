"""RQ (2.x) as a job source: its jobs, registries and workers in Redis, judged in SQL
over one snapshot per transaction (``snapshot``), written in RQ's own shapes under a
fence (``writes``). What every source shares is in ``reconciler.sources.kit``.

- **Running**: an entry of a watched queue's started registry whose job's status is
  ``started``; the kind is its function's name (``kinds``).
- **Liveness**: stale when its worker is gone (no key, dead, silent, or a later worker
  under its name) and the entry went unrenewed: the worker's next heartbeat (the entry's
  score less RQ's grace, against Redis's clock) is ``session_timeout_seconds`` overdue,
  about a minute before the entry expires and a successor under the same name could run
  RQ's own cleanup over it; a kind's ``max_run_seconds``, where set, also counts an
  expired entry whose worker still answers once the run is that long. Wedged (a live
  worker, a silent step ledger) is the kit's.
- **Attempts**: the reconciler's count in the job's hash (1 until a resume); the budget
  is RQ's own where the job has a ``Retry`` (a resume needs a retry left: the attempts
  allowed are this one plus the retries left), else the kind's ``max_attempts``.
- **Fence, resume, terminalize**: ``writes``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.evidence import StepFacts
from reconciler.core.kinds import KindPolicy
from reconciler.core.ports import Candidate, Fence
from reconciler.core.vocabulary import Disposition
from reconciler.sources.kit.batches import Batch, fence_of
from reconciler.sources.kit.declaration import Declaration
from reconciler.sources.kit.shapes import Shape, by_kind, candidate, constant
from reconciler.sources.kit.system import Changed, Policies, Scope, System
from reconciler.sources.rq import keys, writes
from reconciler.sources.rq.config import RqConfig
from reconciler.sources.rq.kinds import UNREADABLE_KIND
from reconciler.sources.rq.listing import STATUS_WORDS, RqListing
from reconciler.sources.rq.snapshot import STARTED, RqLiveness, Snapshot
from reconciler.sources.rq.writes import RqFence


def _judged(scope: Scope) -> Snapshot:
    """Redis's view the kit read for this transaction."""
    if not isinstance(scope.verdict, Snapshot):  # pragma: no cover - the kit's mistake
        raise TypeError("the rq source's functions need Redis's snapshot")
    return scope.verdict


class RqSql:
    """RQ's started jobs as SQL over the transaction's snapshot, and their writes."""

    def __init__(self, config: RqConfig) -> None:
        self.config = config
        self.liveness = RqLiveness(config)

    def _over(self, policies: Policies) -> sa.ColumnElement[Any]:
        """Seconds past the job's end of life (negative while it lives): its worker's
        heartbeat ``session_timeout_seconds`` overdue once its worker is gone, else its run
        past the kind's ``max_run_seconds`` once its entry expired."""
        t = STARTED.c
        max_run = by_kind(t.job_kind, policies, lambda p: p.max_run_seconds)
        ran_over = t.run_seconds - sa.cast(max_run, sa.Double())
        return sa.case(
            (sa.and_(t.worker_gone, t.silent_over >= 0), t.silent_over),
            (sa.and_(t.entry_over >= 0, ran_over >= 0), ran_over),
            else_=sa.literal(-1.0, sa.Double()))

    def running(self, scope: Scope, policies: Policies) -> sa.Select[Any]:
        """Every started job of the watched queues, as Redis was read."""
        t = STARTED.c
        return sa.select(
            t.job_id.label("job_id"), t.job_kind.label("job_kind"), t.unreadable, t.queue,
            t.execution_id, t.score, t.status, t.worker, t.retries_left, t.attempt,
            self._over(policies).label("lease_expired_seconds"),
        ).where(t.status == constant(keys.STARTED_STATUS))

    def expired(self, scope: Scope, policies: Policies) -> sa.ColumnElement[bool]:
        """Its worker gone (or its run too long) past its entry's expiry; or its kind
        unreadable once its entry expired (a candidate, so that it is recorded
        ``reconcile_error``: a live one is not read by a pass)."""
        return sa.or_(sa.and_(STARTED.c.unreadable, STARTED.c.entry_over >= 0),
                      self._over(policies) >= 0)

    def candidate(self, scope: Scope, row: sa.Row[Any], policy: KindPolicy,
                  steps: StepFacts | None, position: bool) -> Candidate:
        """One started job's facts; the job as read is its fence."""
        over = float(row.lease_expired_seconds)
        attempt = int(row.attempt)
        snapshot = RqFence(row.queue, row.execution_id, float(row.score), row.status,
                           row.worker or None, row.retries_left, attempt)
        budget = (policy.max_attempts if row.retries_left is None
                  else attempt + int(row.retries_left))
        found = candidate(
            job_id=str(row.job_id), kind=row.job_kind, policy=policy,
            fence=Fence(attempt, snapshot), attempt_count=attempt, max_attempts=budget,
            lease_live=over < 0, lease_expired_seconds=over if over >= 0 else None,
            steps=steps, session_gone=over >= 0, position=position)
        if row.unreadable:
            return _unreadable(found)
        return found

    def swap(self, scope: Scope, batch: Batch) -> Changed:
        """The batch's jobs written in RQ's shape, each under its own fence, in one
        Redis transaction (``writes.fenced_writes``)."""
        if not _judged(scope).may_swap:
            return {}  # Redis did not answer, or is not the app's: nothing is written
        ids = {str(c.decision.job_id) for c in batch.changes}
        if batch.stalled is not None:  # the wedged rule's predicate, on the ledger
            ids &= set(scope.conn.execute(
                sa.select(STARTED.c.job_id).where(STARTED.c.job_id.in_(sorted(ids)),
                                                  batch.stalled)).scalars())
        jobs = [(str(change.decision.job_id), fence_of(change, RqFence))
                for change in batch.changes if str(change.decision.job_id) in ids]
        client = self.liveness.client()
        if batch.disposition is Disposition.RESUME:
            done = set(writes.resume(client, jobs))
        else:
            done = set(writes.terminalize(client, jobs, batch.reason))
            writes.release_all_dependents(client, sorted(done))
        attempts = {job_id: fence.attempt for job_id, fence in jobs}
        changed: Changed = {}
        for change in batch.changes:
            job_id = str(change.decision.job_id)
            if job_id in done:
                batch.ledger.fence(job_id, attempts[job_id] + 1)
                changed[change.decision.job_id] = attempts[job_id]
        return changed

    def check_schema(self, conn: Connection) -> None:
        """Nothing in SQL: RQ's keys are read from Redis by each pass, which says when
        they cannot be (the installed RQ is the liveness's check)."""


def _unreadable(found: Candidate) -> Candidate:
    """A job whose kind cannot be read: judged ``reconcile_error``, never by a guess."""
    return dataclasses.replace(found, unreadable=(("error_code", UNREADABLE_KIND),
                                                  ("field", "data")))


def declare(config: RqConfig) -> System:
    """RQ's started jobs, judged on one snapshot of Redis per transaction."""
    sql = RqSql(config)
    shown = RqListing(config, sql.liveness.client)
    return System(
        shape=Shape(key=STARTED.c.job_id, kind=STARTED.c.job_kind, locks=STARTED,
                    scans_all_kinds=True, counts_attempts=True, judged_first=True),
        running=sql.running, expired=sql.expired, candidate=sql.candidate, swap=sql.swap,
        check_schema=sql.check_schema, listing=shown.every, listing_for=shown.narrowed,
        status_words=STATUS_WORDS, liveness=sql.liveness)


DECLARATION = Declaration(RqConfig, declare)
