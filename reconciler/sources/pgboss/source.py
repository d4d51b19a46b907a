"""pg-boss (10.x) as a job source: its partitioned ``job`` table and queue policies.

- **Running**: ``state = 'active'``; the kind is the queue name (``name``).
- **Owner liveness**: pg-boss 10 keeps none. The lease is ``started_on`` plus the kind's
  ``max_run_seconds``, else the job's own ``expire_in`` (after which pg-boss's own
  maintenance fails or retries it blindly: a kind's ``max_run_seconds`` below it is what
  lets the pass decide first). An operator's hold pushes ``expire_in`` back
  (``HOLD_PUSHBACK``, taken away again on unhold), so pg-boss's maintenance leaves a held
  job alone; the lease read here is the job's own, without the push.
- **Attempts**: its own: a fetch after a first start increments ``retry_count``, so a
  running job has used ``retry_count + 1`` of ``retry_limit + 1``. An attempt pg-boss's
  own expiry took back (its ``output`` says so) counts as lost for the crash-loop rule,
  where the audit has no resume of ours for it.
- **Fence**: (``state = 'active'``, ``started_on``, ``retry_count``) and the lease still run
  out, for every row of a batch in one ``UPDATE ... FROM unnest(...)``; every statement
  names its queues, so PostgreSQL touches their partitions only. When the batch's statement
  breaks a unique index (a stately queue), each change is swapped alone in a savepoint.
- **Resume**: ``retry``, runnable now (``start_after = now()``); the next fetch counts the
  attempt. A ``stately`` queue keeps one job per state and singleton key: when another job
  holds ``retry`` the job goes back to ``created``, and when both are held it is left as
  it is (the swap changes nothing and the pass records ``fence_lost``) rather than break
  the queue's unique index.
- **Terminalize**: ``failed`` as its own ``fail`` writes it: ``completed_on = now()``, our
  reason in ``output`` (``{"reason": ..., "message": ...}``), and a copy into the queue's
  dead-letter queue when it has one, as pg-boss itself does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as pydantic_dataclass
from sqlalchemy.dialects.postgresql import ENUM, INTERVAL, JSONB, UUID
from sqlalchemy.engine import Connection

from reconciler.config.tables import SourceSettings
from reconciler.core.evidence import StepFacts
from reconciler.core.kinds import KindPolicy
from reconciler.core.ports import Candidate, Fence
from reconciler.core.vocabulary import Disposition, JobStatus
from reconciler.sources.kit.batches import Batch, fence_of
from reconciler.sources.kit.checks import require_schema
from reconciler.sources.kit.declaration import Declaration
from reconciler.sources.kit.fences import ForeignFence
from reconciler.sources.kit.shapes import Shape, candidate, constant, per_kind
from reconciler.sources.kit.system import Changed, Policies, Scope, System
from reconciler.storage.clock import db_now, now_plus, seconds_since
from reconciler.storage.sql import unnest

JOB_STATES = ("created", "retry", "active", "completed", "cancelled", "failed")
HOLD_PUSHBACK = "100 years"
"""What an operator's hold adds to a job's ``expire_in`` (and its release takes away), so
pg-boss's own expiry never fails or retries a held job; the lease this source reads is
the job's own, without it."""
EXPIRED_BY_PGBOSS = "job failed by timeout in active state"
"""The message pg-boss's own maintenance writes into a job's ``output`` when it expires an
active job (``failJobsByTimeout``): the run before is one it took back, lost."""
_STATUS_WORDS = {"created": JobStatus.QUEUED, "retry": JobStatus.QUEUED,
                 "active": JobStatus.PROCESSING, "completed": JobStatus.COMPLETED,
                 "cancelled": JobStatus.CANCELLED, "failed": JobStatus.FAILED}


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class PgBossConfig(SourceSettings):
    """``kind = "pg-boss"``: pg-boss's partitioned ``job`` table."""

    kind: ClassVar[str] = "pg-boss"
    schema: str = "pgboss"


@dataclass(frozen=True, slots=True)
class PgBossFence(ForeignFence):
    """What a pg-boss swap repeats: the queue (its partition), the start, the retries, and
    the lease it judged."""

    name: str
    started_on: datetime
    retry_count: int
    lease_seconds: float


@dataclass(frozen=True, slots=True)
class PgBossSql:
    """pg-boss's own SQL over its tables, named by the config."""

    schema: str
    jobs: sa.TableClause
    queues: sa.TableClause
    state_type: ENUM

    @classmethod
    def of(cls, config: PgBossConfig) -> PgBossSql:
        """Its tables in the configured schema."""
        return cls(config.schema, sa.table(
            "job", sa.column("id", UUID(as_uuid=False)), sa.column("name"), sa.column("state"),
            sa.column("retry_count"), sa.column("retry_limit"), sa.column("started_on"),
            sa.column("start_after"), sa.column("expire_in"), sa.column("policy"),
            sa.column("singleton_key"), sa.column("completed_on"), sa.column("keep_until"),
            sa.column("dead_letter"), sa.column("data", JSONB), sa.column("output", JSONB),
            sa.column("created_on"),
            schema=config.schema),
            sa.table("queue", sa.column("name"), schema=config.schema),
            ENUM(*JOB_STATES, name="job_state", schema=config.schema, create_type=False))

    def check_schema(self, conn: Connection) -> None:
        """pg-boss's job table and the columns this source reads and writes."""
        require_schema(conn, PgBossConfig.kind, self.schema, {
            "job": ("id", "name", "state", "retry_count", "retry_limit", "started_on",
                    "start_after", "expire_in", "policy", "singleton_key", "completed_on",
                    "keep_until", "dead_letter", "data", "output")},
            missing_schema=" (has pg-boss started on this database?)")

    # -- SQL pieces ---------------------------------------------------------- #

    def _expire_seconds(self) -> sa.ColumnElement[Any]:
        """The job's own ``expire_in`` in seconds, without a hold's push (``HOLD_PUSHBACK``),
        so a held job is judged, and recorded held, as it would be without the hold."""
        expire_in, push = self.jobs.c.expire_in, sa.cast(sa.literal(HOLD_PUSHBACK), INTERVAL)
        own = sa.case((expire_in >= push, expire_in - push), else_=expire_in)
        return sa.cast(sa.func.extract("epoch", own), sa.Float())

    def _lease_seconds(self, policies: Policies) -> sa.ColumnElement[Any]:
        by_kind = per_kind(self.jobs.c.name, {k: p.max_run_seconds
                                              for k, p in policies.items()})
        return sa.func.coalesce(by_kind, self._expire_seconds())

    def running(self, scope: Scope, policies: Policies) -> sa.Select[Any]:
        """Every ``active`` job, its start's age and how far past its lease."""
        jobs = self.jobs
        claim_age = seconds_since(jobs.c.started_on)
        return (
            sa.select(jobs.c.id.label("job_id"), jobs.c.name.label("job_kind"),
                      jobs.c.started_on, jobs.c.retry_count, jobs.c.retry_limit,
                      claim_age.label("claim_age"),
                      self._expire_seconds().label("expire_seconds"),
                      (jobs.c.output["value"]["message"].astext == EXPIRED_BY_PGBOSS)
                      .label("expired_by_pgboss"),
                      (claim_age - self._lease_seconds(policies)).label("lease_expired_seconds"))
            .where(jobs.c.state == constant("active"))
        )

    def expired(self, scope: Scope, policies: Policies) -> sa.ColumnElement[bool]:
        """Started longer ago than its lease."""
        return self.jobs.c.started_on < now_plus(-self._lease_seconds(policies))

    @staticmethod
    def candidate(scope: Scope, row: sa.Row[Any], policy: KindPolicy,
                  steps: StepFacts | None, position: bool) -> Candidate:
        """One ``active`` job's facts; its queue, start and retries are the fence."""
        lease = policy.max_run_seconds or float(row.expire_seconds)
        overrun = float(row.claim_age) - lease
        retries = int(row.retry_count)
        return candidate(
            job_id=str(row.job_id), kind=row.job_kind, policy=policy,
            fence=Fence(retries, PgBossFence(row.job_kind, row.started_on, retries, lease)),
            attempt_count=retries + 1, max_attempts=int(row.retry_limit) + 1,
            lease_live=overrun < 0, lease_expired_seconds=overrun if overrun >= 0 else None,
            steps=steps, position=position,
            # pg-boss's own expiry took an earlier run back (and wrote so), unrecorded by
            # the reconciler: the crash-loop count counts it.
            lost_to_system=bool(row.expired_by_pgboss) and retries > 0,
        )

    # -- for operators ------------------------------------------------------ #

    def listing(self, conn: Connection) -> sa.Select[Any]:
        """Every pg-boss job of every queue."""
        jobs = self.jobs
        started = sa.case((jobs.c.started_on.is_not(None), 1), else_=0)
        return sa.select(
            jobs.c.id.label("job_id"), jobs.c.name.label("job_kind"),
            sa.cast(jobs.c.state, sa.Text()).label("source_status"),
            (jobs.c.retry_count + started).label("attempts"),
            (jobs.c.retry_limit + 1).label("max_attempts"),
            jobs.c.output["reason"].astext.label("reason"),
            jobs.c.created_on.label("created_at"),
            sa.func.coalesce(jobs.c.completed_on, jobs.c.started_on, jobs.c.created_on)
            .label("updated_at"), jobs.c.completed_on.label("finished_at"))

    # -- applying ------------------------------------------------------------ #

    def swap(self, scope: Scope, batch: Batch) -> Changed:
        """The batch in one statement, else (a unique index broken) each change alone."""
        try:
            # A savepoint: a unique index a concurrent insert (or two jobs of one stately
            # queue and key in the same batch) makes us violate costs this batch's
            # statement, not the pass; each of its changes is then swapped alone.
            with scope.conn.begin_nested():
                return self._swap_set(scope.conn, batch)
        except sa.exc.IntegrityError:
            if len(batch.changes) == 1:
                return {}
        changed: Changed = {}
        for change in batch.changes:
            changed.update(self.swap(scope, dataclasses.replace(batch, changes=(change,))))
        return changed

    def _swap_set(self, conn: Connection, batch: Batch) -> Changed:
        jobs = self.jobs
        fences = [fence_of(change, PgBossFence) for change in batch.changes]
        seen = unnest("seen", [
            ("id", UUID(as_uuid=False), [str(c.decision.job_id) for c in batch.changes]),
            ("name", sa.Text(), [f.name for f in fences]),
            ("started_on", sa.DateTime(timezone=True), [f.started_on for f in fences]),
            ("retry_count", sa.Integer(), [f.retry_count for f in fences]),
            ("lease_seconds", sa.Float(), [f.lease_seconds for f in fences])])
        still = (jobs.c.started_on < now_plus(-seen.c.lease_seconds) if batch.stalled is None
                 else batch.stalled)
        # The queues named as constants too, so PostgreSQL touches their partitions only.
        fenced = (jobs.c.name.in_(sorted({f.name for f in fences})),
                  jobs.c.name == seen.c.name, jobs.c.id == seen.c.id,
                  jobs.c.state == constant("active"), jobs.c.started_on == seen.c.started_on,
                  jobs.c.retry_count == seen.c.retry_count, still)
        if batch.disposition is Disposition.RESUME:
            swapped = self._requeue(conn, fenced)
        else:
            swapped = self._fail(conn, fenced, batch.reason)
        retries = {str(c.decision.job_id): f.retry_count
                   for c, f in zip(batch.changes, fences, strict=True)}
        changed: Changed = {}
        for job_id in swapped:
            batch.ledger.fence(job_id, retries[job_id] + 1)
            changed[job_id] = retries[job_id]
        return changed

    def _stately_sibling(self, state: str) -> sa.ColumnElement[bool]:
        """Another job of the same stately queue and singleton key already in ``state``."""
        jobs, other = self.jobs, self.jobs.alias("sibling")
        return sa.and_(jobs.c.policy == constant("stately"), sa.exists().where(
            other.c.name == jobs.c.name, other.c.id != jobs.c.id,
            other.c.state == constant(state), other.c.policy == constant("stately"),
            sa.func.coalesce(other.c.singleton_key, "") ==
            sa.func.coalesce(jobs.c.singleton_key, "")))

    def _requeue(self, conn: Connection, fenced: tuple[sa.ColumnElement[bool], ...]
                 ) -> list[str]:
        jobs = self.jobs
        retry_held, created_held = self._stately_sibling("retry"), self._stately_sibling(
            "created")
        state = sa.cast(sa.case((retry_held, constant("created")), else_=constant("retry")),
                        self.state_type)
        return [str(job_id) for job_id in conn.execute(
            jobs.update().where(*fenced, sa.not_(sa.and_(retry_held, created_held)))
            .values(state=state, start_after=db_now()).returning(jobs.c.id)).scalars()]

    def _fail(self, conn: Connection, fenced: tuple[sa.ColumnElement[bool], ...],
              reason: str) -> list[str]:
        jobs = self.jobs
        output = sa.func.jsonb_build_object("reason", reason, "message", reason)
        failed = conn.execute(
            jobs.update().where(*fenced)
            .values(state=constant("failed"), completed_on=db_now(), output=output)
            .returning(jobs.c.id, jobs.c.name, jobs.c.data, jobs.c.output, jobs.c.retry_limit,
                       jobs.c.keep_until, jobs.c.start_after, jobs.c.dead_letter)).all()
        copies = [{"name": f.dead_letter, "data": f.data, "output": f.output,
                   "retry_limit": f.retry_limit,
                   "keep_until": f.keep_until + (f.keep_until - f.start_after)}
                  for f in failed if f.dead_letter is not None and f.dead_letter != f.name]
        if copies:
            # As pg-boss's own fail does: a copy of each failed job into its dead-letter
            # queue.
            conn.execute(jobs.insert(), copies)
        return [str(f.id) for f in failed]


def declare(config: PgBossConfig) -> System:
    """pg-boss's jobs, leased by their kind's ``max_run_seconds`` (else ``expire_in``)."""
    sql = PgBossSql.of(config)
    return System(
        shape=Shape(
            key=sql.jobs.c.id, kind=sql.jobs.c.name, locks=sql.jobs,
            # A uuid's bytes compare as the uuid does; the (name, id) primary key does not
            # serve this order, so a quiet scan is one read of the active rows, not a walk
            # of the whole key.
            scan_order=sa.func.uuid_send(sql.jobs.c.id),
            # Its queues: every job names one (a foreign key).
            kind_catalogue=sa.select(sql.queues.c.name)),
        running=sql.running, expired=sql.expired, candidate=sql.candidate, swap=sql.swap,
        check_schema=sql.check_schema, listing=sql.listing, status_words=_STATUS_WORDS)


DECLARATION = Declaration(PgBossConfig, declare)
