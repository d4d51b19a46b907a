"""The schema: typed SQLAlchemy 2.0 models. Names are public (docs/data-model.md)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    String,
    event,
    text,
)
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base, JobKeyText
from reconciler.core import vocabulary as v
from reconciler.core.vocabulary import (
    ActionOutcome,
    ArtifactState,
    AttemptOutcome,
    Disposition,
    EffectKind,
    EndedBy,
    JobStatus,
    PassOutcome,
    SessionEndReason,
    StepState,
)

# SQLite only auto-assigns keys to a column declared exactly INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")

# Every vocabulary comes from the one definition in reconciler.core.vocabulary.
JOB_STATUSES = tuple(JobStatus)
STEP_STATES = tuple(StepState)
EFFECT_KINDS = tuple(EffectKind)
ATTEMPT_OUTCOMES = tuple(AttemptOutcome)
ENDED_BY = tuple(EndedBy)
PASS_OUTCOMES = tuple(PassOutcome)
DISPOSITIONS = tuple(Disposition)
ARTIFACT_STATES = tuple(ArtifactState)
OPERATOR_ACTIONS = tuple(v.OperatorAction)
ACTION_OUTCOMES = tuple(ActionOutcome)
SESSION_END_REASONS = tuple(SessionEndReason)

# The engines with partial indexes; an index only they can have is created on them only
# (alembic/env.py leaves it out of ``alembic check`` elsewhere).
PARTIAL_INDEXES = ("postgresql", "sqlite")
PROCESSING = text("job_status = 'processing'")
QUEUED = text("job_status = 'queued'")
# What the pass scans: running jobs, less those parked once their hold or gate was recorded.
SCANNED = text("job_status = 'processing' AND NOT reconcile_parked")
# The statuses a job never leaves on its own: what job retention may delete.
FINISHED_STATUSES = (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)
# The console lists held and parked jobs: few among many, so only they are indexed.
HELD = text("operator_hold")
PARKED = text("reconcile_parked")
# Set when a job finishes, cleared when it is resumed or retried.
HAS_FINISHED = text("finished_at IS NOT NULL")


def one_of(column: str, values: tuple[StrEnum, ...]) -> str:
    """SQL for a CHECK that keeps a short-code column inside its vocabulary."""
    quoted = ", ".join(f"'{v.value}'" for v in values)
    return f"{column} IN ({quoted})"



class JobRun(Base):
    """One row per public job: its status, plan, attempt budget and current lease."""

    __tablename__ = "job_runs"

    job_id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_kind: Mapped[str] = mapped_column(String(v.JOB_KIND_MAX_LENGTH))
    job_status: Mapped[str] = mapped_column(String(16))
    status_reason: Mapped[str | None] = mapped_column(String(64))
    step_plan: Mapped[Any | None] = mapped_column(JSON)
    resume_step_index: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    attempt_count: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    max_attempts: Mapped[int] = mapped_column(Integer)
    claim_generation: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    lease_token: Mapped[str | None] = mapped_column(String(64))
    lease_owner: Mapped[str | None] = mapped_column(String(v.WORKER_NAME_MAX_LENGTH))
    lease_expires_at: Mapped[datetime | None]
    claimed_at: Mapped[datetime | None]
    last_activity_at: Mapped[datetime | None]
    available_at: Mapped[datetime]
    idempotency_key: Mapped[str | None] = mapped_column(String(v.JOB_KEY_MAX_LENGTH),
                                                        unique=True)
    singleton_key: Mapped[str | None] = mapped_column(String(v.JOB_KEY_MAX_LENGTH))
    operator_hold: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # Internal: set by a pass once it recorded the job held or waiting on its gate, so the
    # candidate scans pass over it; any worker write, operator action or decision clears it.
    reconcile_parked: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    last_error_code: Mapped[str | None] = mapped_column(String(64))
    job_payload: Mapped[Any | None] = mapped_column(JSON)
    # Internal: the worker session holding the claim, so a gone session frees it early.
    worker_session_id: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]

    __table_args__ = (
        CheckConstraint(one_of("job_status", JOB_STATUSES), name="job_status_known"),
        CheckConstraint("max_attempts >= 1", name="max_attempts_positive"),
        CheckConstraint("attempt_count >= 0", name="attempt_count_not_negative"),
        CheckConstraint("resume_step_index >= 0", name="resume_step_index_not_negative"),
        # A processing job always carries a lease the reconciler can judge.
        CheckConstraint(
            "job_status <> 'processing' OR (lease_token IS NOT NULL"
            " AND lease_expires_at IS NOT NULL AND last_activity_at IS NOT NULL)",
            name="processing_has_lease",
        ),
        # Candidate scans of the pass: cost follows the batch, not the table (and not the
        # number of held or gated jobs either).
        Index(
            "ix_job_runs_processing_lease_expiry", "lease_expires_at", "job_id",
            postgresql_where=SCANNED, sqlite_where=SCANNED,
        ).ddl_if(dialect=PARTIAL_INDEXES),  # type: ignore[arg-type]  # a tuple is documented
        Index(
            "ix_job_runs_processing_last_activity", "last_activity_at", "job_id",
            postgresql_where=SCANNED, sqlite_where=SCANNED,
        ).ddl_if(dialect=PARTIAL_INDEXES),  # type: ignore[arg-type]
        Index(
            "ix_job_runs_queued_available", "available_at", "job_id",
            postgresql_where=QUEUED, sqlite_where=QUEUED,
        ).ddl_if(dialect=PARTIAL_INDEXES),  # type: ignore[arg-type]
        # MySQL has no partial index: the status leads instead, so the claim and the scans
        # still read a range of their own rows only, in order (reconciler.storage.sql.along).
        Index("ix_job_runs_status_lease_expiry", "job_status", "lease_expires_at",
              "job_id").ddl_if(dialect="mysql"),
        Index("ix_job_runs_status_last_activity", "job_status", "last_activity_at",
              "job_id").ddl_if(dialect="mysql"),
        Index("ix_job_runs_status_available", "job_status", "available_at",
              "job_id").ddl_if(dialect="mysql"),
        # On MySQL, which has no partial index, its meaning is MYSQL_PROCESSING_SINGLETON.
        Index(
            "uq_job_runs_processing_singleton", "singleton_key", unique=True,
            postgresql_where=PROCESSING, sqlite_where=PROCESSING,
        ).ddl_if(dialect=PARTIAL_INDEXES),  # type: ignore[arg-type]
        # Operator listings filter by status and page newest first.
        Index("ix_job_runs_status_job", "job_status", "job_id"),
        Index(
            "ix_job_runs_processing_session", "worker_session_id",
            postgresql_where=PROCESSING, sqlite_where=PROCESSING,
        ),
        Index("ix_job_runs_held_job", "job_id", postgresql_where=HELD, sqlite_where=HELD),
        Index("ix_job_runs_parked_job", "job_id", postgresql_where=PARKED,
              sqlite_where=PARKED),
        # Job retention pages finished jobs oldest first; only finished jobs are indexed.
        # (Its ``finished_at < cutoff`` implies the predicate on both engines.)
        Index(
            "ix_job_runs_finished_at", "finished_at", "job_id",
            postgresql_where=HAS_FINISHED, sqlite_where=HAS_FINISHED,
        ),
    )


class StepRun(Base):
    """The latest state of one step of a job; a step with no row never started."""

    __tablename__ = "step_runs"

    job_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("job_runs.job_id", ondelete="CASCADE"), primary_key=True
    )
    step_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    step_name: Mapped[str] = mapped_column(String(v.STEP_NAME_MAX_LENGTH))
    effect_kind: Mapped[str] = mapped_column(String(16))
    step_state: Mapped[str] = mapped_column(String(16))
    claim_generation: Mapped[int] = mapped_column(BigInteger)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    error_code: Mapped[str | None] = mapped_column(String(64))
    failure_retryable: Mapped[bool | None] = mapped_column(Boolean)

    __table_args__ = (
        CheckConstraint(one_of("step_state", STEP_STATES), name="step_state_known"),
        CheckConstraint(one_of("effect_kind", EFFECT_KINDS), name="effect_kind_known"),
    )


class JobAttempt(Base):
    """History: one row per claim, closed by whoever ended that claim."""

    __tablename__ = "job_attempts"

    job_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("job_runs.job_id", ondelete="CASCADE"), primary_key=True
    )
    claim_generation: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    attempt_number: Mapped[int] = mapped_column(Integer)
    lease_owner: Mapped[str | None] = mapped_column(String(v.WORKER_NAME_MAX_LENGTH))
    claimed_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]
    attempt_outcome: Mapped[str | None] = mapped_column(String(16))
    ended_by: Mapped[str | None] = mapped_column(String(16))

    __table_args__ = (
        CheckConstraint(one_of("attempt_outcome", ATTEMPT_OUTCOMES), name="attempt_outcome_known"),
        CheckConstraint(one_of("ended_by", ENDED_BY), name="ended_by_known"),
    )


class ReconciliationPass(Base):
    """One row per pass; counters move in the same transactions as the decisions."""

    __tablename__ = "reconciliation_passes"

    pass_id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    reconciler_instance: Mapped[str] = mapped_column(String(200))
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    candidates_seen: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    resumed_count: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    terminalized_count: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    skipped_count: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    pass_outcome: Mapped[str | None] = mapped_column(String(16))
    error_code: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (
        CheckConstraint(one_of("pass_outcome", PASS_OUTCOMES), name="pass_outcome_known"),
        Index("ix_reconciliation_passes_started_at", "started_at"),
    )


class ReconciliationDecision(Base):
    """The audit trail: every decision of every pass, with privacy-safe evidence."""

    __tablename__ = "reconciliation_decisions"

    decision_id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    pass_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("reconciliation_passes.pass_id", ondelete="CASCADE")
    )
    # Which job source the job lives in (native: job_runs), and its id as that source
    # spells it (a pg-boss UUID, a Procrastinate integer), as text. No foreign key: the
    # audit trail outlives the jobs it describes.
    job_source: Mapped[str] = mapped_column(String(32), server_default=text("'native'"))
    job_id: Mapped[str] = mapped_column(JobKeyText())
    # The job's kind as the source read it when it decided (a Celery task name): the
    # console shows and filters it for every source, and it outlives the job. NULL for
    # decisions recorded before it was kept.
    job_kind: Mapped[str | None] = mapped_column(String(v.RECORDED_KIND_MAX_LENGTH))
    decided_at: Mapped[datetime]
    disposition: Mapped[str] = mapped_column(String(16))
    decision_reason: Mapped[str] = mapped_column(String(64))
    generation_before: Mapped[int | None] = mapped_column(BigInteger)
    generation_after: Mapped[int | None] = mapped_column(BigInteger)
    resume_step_index: Mapped[int | None] = mapped_column(Integer)
    decision_evidence: Mapped[Any | None] = mapped_column(JSON)
    # A shadow pass records what it would have done and changes no job.
    shadow_mode: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))

    __table_args__ = (
        CheckConstraint(one_of("disposition", DISPOSITIONS), name="disposition_known"),
        # `reconciler decisions --shadow` pages shadow decisions newest first.
        Index("ix_reconciliation_decisions_shadow_mode_decision", "shadow_mode",
              "decision_id"),
        Index("ix_reconciliation_decisions_pass_id", "pass_id"),
        Index("ix_reconciliation_decisions_source_job", "job_source", "job_id"),
        Index("ix_reconciliation_decisions_decided_at", "decided_at"),
        Index("ix_reconciliation_decisions_reason_decision", "decision_reason", "decision_id"),
    )


class ReconcilerLease(Base):
    """The leader lease shared by reconciler replicas, fenced by a monotonic token."""

    __tablename__ = "reconciler_leases"

    lease_name: Mapped[str] = mapped_column(String(100), primary_key=True)
    holder_id: Mapped[str] = mapped_column(String(200))
    fencing_token: Mapped[int] = mapped_column(BigInteger)
    lease_expires_at: Mapped[datetime]


LIVE_SESSION = text("stopped_at IS NULL")


class WorkerSession(Base):
    """One row per worker process; claims record it so a gone process frees them early."""

    __tablename__ = "worker_sessions"

    session_id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    worker_name: Mapped[str] = mapped_column(String(200))
    host_name: Mapped[str] = mapped_column(String(200))
    process_id: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime]
    heartbeat_at: Mapped[datetime]
    stopped_at: Mapped[datetime | None]
    stop_reason: Mapped[str | None] = mapped_column(String(16))

    __table_args__ = (
        CheckConstraint(one_of("stop_reason", SESSION_END_REASONS), name="stop_reason_known"),
        # Only live sessions are ever scanned: a restart finds its predecessor, the
        # session sweep finds the silent ones.
        Index("ix_worker_sessions_live_identity", "worker_name", "host_name",
              postgresql_where=LIVE_SESSION, sqlite_where=LIVE_SESSION),
        Index("ix_worker_sessions_live_heartbeat", "heartbeat_at",
              postgresql_where=LIVE_SESSION, sqlite_where=LIVE_SESSION,
              ).ddl_if(dialect=PARTIAL_INDEXES),  # type: ignore[arg-type]
        # MySQL: the live sessions (no stop) first, so the sweep's range is theirs only.
        Index("ix_worker_sessions_stopped_heartbeat", "stopped_at", "heartbeat_at",
              ).ddl_if(dialect="mysql"),
    )


STAGED = text("artifact_state = 'staged'")


class JobArtifact(Base):
    """An artifact staged by one attempt; only the completing generation's set is published."""

    __tablename__ = "job_artifacts"

    job_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("job_runs.job_id", ondelete="CASCADE"), primary_key=True
    )
    claim_generation: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    artifact_name: Mapped[str] = mapped_column(String(200), primary_key=True)
    artifact_state: Mapped[str] = mapped_column(String(16))
    staged_at: Mapped[datetime]
    settled_at: Mapped[datetime | None]

    __table_args__ = (
        CheckConstraint(one_of("artifact_state", ARTIFACT_STATES), name="artifact_state_known"),
        Index("ix_job_artifacts_staged_job", "job_id", "claim_generation",
              postgresql_where=STAGED, sqlite_where=STAGED),
    )


class OperatorAction(Base):
    """Every operator action on a job of any source, recorded like a reconciler decision:
    which source, the job's key as it spells it, who, why, and the state it moved."""

    __tablename__ = "operator_actions"

    action_id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[int | None] = mapped_column(BigInteger)
    """The native job's id; NULL for a foreign job (its ``job_key`` names it)."""
    job_source: Mapped[str] = mapped_column(String(v.SOURCE_NAME_MAX_LENGTH),
                                            server_default=text("'native'"))
    job_key: Mapped[str] = mapped_column(JobKeyText)
    operator_action: Mapped[str] = mapped_column(String(16))
    action_outcome: Mapped[str] = mapped_column(String(16))
    refusal_reason: Mapped[str | None] = mapped_column(String(64))
    acted_by: Mapped[str | None] = mapped_column(String(v.ACTOR_MAX_LENGTH))
    operator_note: Mapped[str | None] = mapped_column(String(v.NOTE_MAX_LENGTH))
    acted_at: Mapped[datetime]
    status_before: Mapped[str | None] = mapped_column(String(16))
    status_after: Mapped[str | None] = mapped_column(String(16))
    state_before: Mapped[str | None] = mapped_column(String(v.STATE_MAX_LENGTH))
    state_after: Mapped[str | None] = mapped_column(String(v.STATE_MAX_LENGTH))
    generation_before: Mapped[int | None] = mapped_column(BigInteger)
    generation_after: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        CheckConstraint(one_of("operator_action", OPERATOR_ACTIONS), name="operator_action_known"),
        CheckConstraint(one_of("action_outcome", ACTION_OUTCOMES), name="action_outcome_known"),
        Index("ix_operator_actions_job_id", "job_id"),
        Index("ix_operator_actions_job_source_job_key", "job_source", "job_key"),
    )


class OperatorHold(Base):
    """The reconciler's own hold on a foreign job (its system has no place for one): a
    pass skips the job with ``operator_hold`` while the row exists."""

    __tablename__ = "operator_holds"

    job_source: Mapped[str] = mapped_column(String(v.SOURCE_NAME_MAX_LENGTH), primary_key=True)
    job_key: Mapped[str] = mapped_column(JobKeyText, primary_key=True)
    held_by: Mapped[str | None] = mapped_column(String(v.ACTOR_MAX_LENGTH))
    held_at: Mapped[datetime]


MYSQL_PROCESSING_SINGLETON = (
    "ALTER TABLE job_runs ADD COLUMN processing_singleton_key VARCHAR(200) AS "
    "(IF(job_status = 'processing', singleton_key, NULL)) STORED",
    "CREATE UNIQUE INDEX uq_job_runs_processing_singleton "
    "ON job_runs (processing_singleton_key)",
)
"""One processing job per singleton key on MySQL, which has no partial index: a stored
generated column holds the key only while the job is processing, unique (any number of
NULLs pass). Not a model column (nothing reads it); ``base.compared_on`` leaves it out."""


@event.listens_for(JobRun.__table__, "after_create")
def _mysql_processing_singleton(_table: object, connection: Connection, **_kw: Any) -> None:
    if connection.dialect.name == "mysql":
        for statement in MYSQL_PROCESSING_SINGLETON:
            connection.exec_driver_sql(statement)
