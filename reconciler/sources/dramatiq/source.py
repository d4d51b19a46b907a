"""Dramatiq (2.x, its Redis broker) as a job source: its fetched messages in Redis, judged
in SQL over one snapshot per transaction (``snapshot``), moved in Dramatiq's own shapes
under a fence (``writes``). What every source shares is in ``reconciler.sources.kit``.

- **Running**: a message in a watched queue's acks set of some worker; the kind is its
  actor's name. Whether it started is the middleware's mark
  (``reconciler.integrations.dramatiq``): unmarked, it was only prefetched.
- **Liveness**: its worker's heartbeat still for ``session_timeout_seconds`` of Redis's
  clock (``silence``); a worker is one process (its broker id), never a name.
- **Attempts**: Dramatiq's own ``retries`` option; this run is ``retries + 1`` once it
  started, and a message only prefetched has used ``retries`` (so a message a worker
  prefetched when another message killed it is never counted into a crash loop). The
  budget is ``max_retries + 1`` as the worker's Retries middleware reads it (the mark
  carries it), else the kind's ``max_attempts``.
- **Steps**: the step ledger where the actor records them; else one step of the kind's
  effect, started (marked started), succeeded (marked finished: the worker died before
  its acknowledgement, ``completion_unrecorded``) or never started (unmarked).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from reconciler.core.evidence import PlanStep, StepFacts
from reconciler.core.kinds import KindPolicy
from reconciler.core.ports import Candidate, Fence
from reconciler.core.vocabulary import Disposition, StepState
from reconciler.sources.dramatiq import writes
from reconciler.sources.dramatiq.config import DramatiqConfig
from reconciler.sources.dramatiq.listing import STATUS_WORDS, DramatiqListing
from reconciler.sources.dramatiq.snapshot import (
    FETCHED,
    UNREADABLE_MESSAGE,
    DramatiqLiveness,
    Snapshot,
)
from reconciler.sources.dramatiq.writes import DramatiqFence
from reconciler.sources.kit.batches import Batch, fence_of
from reconciler.sources.kit.declaration import Declaration
from reconciler.sources.kit.shapes import Shape, candidate
from reconciler.sources.kit.system import Changed, Policies, Scope, System
from reconciler.storage.audit import FETCHED_ONLY


def _judged(scope: Scope) -> Snapshot:
    if not isinstance(scope.verdict, Snapshot):  # pragma: no cover - the kit's mistake
        raise TypeError("the dramatiq source's functions need Redis's snapshot")
    return scope.verdict


class DramatiqSql:
    """Dramatiq's fetched messages as SQL over the transaction's snapshot, and their moves."""

    def __init__(self, config: DramatiqConfig) -> None:
        self.config = config
        self.liveness = DramatiqLiveness(config)

    def running(self, scope: Scope, policies: Policies) -> sa.Select[Any]:
        """Every fetched message loaded (a pass loads its gone workers' only)."""
        t = FETCHED.c
        return sa.select(
            t.job_id.label("job_id"), t.job_kind.label("job_kind"), t.unreadable, t.queue,
            t.redis_id, t.broker_id, t.data_sha1, t.mark, t.started, t.finished, t.retries,
            t.heartbeat,
            t.max_retries, t.silent_over.label("lease_expired_seconds"))

    def expired(self, scope: Scope, policies: Policies) -> sa.ColumnElement[bool]:
        """Its worker's heartbeat still past ``session_timeout_seconds``."""
        return FETCHED.c.silent_over >= 0

    def candidate(self, scope: Scope, row: sa.Row[Any], policy: KindPolicy,
                  steps: StepFacts | None, position: bool) -> Candidate:
        """One fetched message's facts; the message as read is its fence."""
        over = float(row.lease_expired_seconds)
        ran = bool(row.started) or bool(row.finished)
        attempt = int(row.retries) + (1 if ran else 0)
        fence = DramatiqFence(row.queue, row.redis_id, row.broker_id, row.data_sha1,
                              row.mark, ran, float(row.heartbeat))
        budget = (policy.max_attempts if row.max_retries is None
                  else int(row.max_retries) + 1)
        found = candidate(
            job_id=str(row.job_id), kind=row.job_kind, policy=policy,
            fence=Fence(attempt, fence), attempt_count=attempt, max_attempts=budget,
            lease_live=over < 0, lease_expired_seconds=over if over >= 0 else None,
            steps=steps if steps is not None else _own_steps(policy, row),
            session_gone=over >= 0, position=position,
            # Said in the evidence: a put-back uses no attempt, and the audit's history
            # never counts it as one lost (``AuditHistory.applied_resumes``).
            owner=() if ran else ((FETCHED_ONLY, True),))
        if row.unreadable:
            return dataclasses.replace(found, unreadable=(
                ("error_code", UNREADABLE_MESSAGE), ("field", "message")))
        return found

    def swap(self, scope: Scope, batch: Batch) -> Changed:
        """The batch's messages moved in Dramatiq's shape, each under its own fence."""
        if not _judged(scope).may_swap:
            return {}
        messages = [(str(change.decision.job_id), fence_of(change, DramatiqFence))
                    for change in batch.changes]
        client, keys = self.liveness.client(), self.liveness.keys
        if batch.disposition is Disposition.RESUME:
            done = set(writes.resume(client, keys, messages))
        else:
            done = set(writes.terminalize(client, keys, messages, batch.reason))
        changed: Changed = {}
        for change in batch.changes:
            job_id = str(change.decision.job_id)
            if job_id in done:
                generation = change.fence.generation or 0
                if fence_of(change, DramatiqFence).started:
                    # The run that started is over: its late step writes record nothing.
                    batch.ledger.fence(job_id, generation + 1)
                changed[change.decision.job_id] = generation
        return changed

    def check_schema(self, conn: Connection) -> None:
        """Nothing in SQL: Dramatiq's keys are read from Redis by each pass."""


def _own_steps(policy: KindPolicy, row: sa.Row[Any]) -> StepFacts:
    """One step of the kind's effect: started, succeeded or never started, as marked."""
    plan = (PlanStep(policy.kind or "job", policy.effect),)
    if row.finished:
        return StepFacts(plan, ((0, StepState.SUCCEEDED.value, None),), None)
    if row.started:
        return StepFacts(plan, ((0, StepState.STARTED.value, None),), None)
    return StepFacts(plan, (), None)


def declare(config: DramatiqConfig) -> System:
    """Dramatiq's fetched messages, judged on one snapshot of Redis per transaction."""
    sql = DramatiqSql(config)
    shown = DramatiqListing(config, sql.liveness.client)
    return System(
        shape=Shape(key=FETCHED.c.job_id, kind=FETCHED.c.job_kind, locks=FETCHED,
                    scans_all_kinds=True, counts_attempts=True, judged_first=True),
        running=sql.running, expired=sql.expired, candidate=sql.candidate, swap=sql.swap,
        check_schema=sql.check_schema, listing=shown.every, listing_for=shown.narrowed,
        status_words=STATUS_WORDS, liveness=sql.liveness)


DECLARATION = Declaration(DramatiqConfig, declare)
