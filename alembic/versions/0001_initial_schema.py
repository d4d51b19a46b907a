"""Initial schema: jobs, steps, attempts, passes, decisions, leader lease.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 09:12:30.339654
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from models.base import UtcDateTime
from models.tables import MYSQL_PROCESSING_SINGLETON

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('job_runs',
    sa.Column('job_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_kind', sa.String(length=100), nullable=False),
    sa.Column('job_status', sa.String(length=16), nullable=False),
    sa.Column('status_reason', sa.String(length=64), nullable=True),
    sa.Column('step_plan', sa.JSON(), nullable=True),
    sa.Column('resume_step_index', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('attempt_count', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('max_attempts', sa.Integer(), nullable=False),
    sa.Column('claim_generation', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('lease_token', sa.String(length=64), nullable=True),
    sa.Column('lease_owner', sa.String(length=200), nullable=True),
    sa.Column('lease_expires_at', UtcDateTime(), nullable=True),
    sa.Column('claimed_at', UtcDateTime(), nullable=True),
    sa.Column('last_activity_at', UtcDateTime(), nullable=True),
    sa.Column('available_at', UtcDateTime(), nullable=False),
    sa.Column('idempotency_key', sa.String(length=200), nullable=True),
    sa.Column('singleton_key', sa.String(length=200), nullable=True),
    sa.Column('operator_hold', sa.Boolean(), server_default=sa.text('(false)'), nullable=False),
    sa.Column('last_error_code', sa.String(length=64), nullable=True),
    sa.Column('job_payload', sa.JSON(), nullable=True),
    sa.Column('created_at', UtcDateTime(), nullable=False),
    sa.Column('updated_at', UtcDateTime(), nullable=False),
    sa.Column('finished_at', UtcDateTime(), nullable=True),
    sa.CheckConstraint("job_status IN ('queued', 'processing', 'waiting', 'completed', 'failed', 'cancelled')", name=op.f('ck_job_runs_job_status_known')),
    sa.CheckConstraint('attempt_count >= 0', name=op.f('ck_job_runs_attempt_count_not_negative')),
    sa.CheckConstraint('max_attempts >= 1', name=op.f('ck_job_runs_max_attempts_positive')),
    sa.CheckConstraint("job_status <> 'processing' OR (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL AND last_activity_at IS NOT NULL)", name=op.f('ck_job_runs_processing_has_lease')),
    sa.CheckConstraint('resume_step_index >= 0', name=op.f('ck_job_runs_resume_step_index_not_negative')),
    sa.PrimaryKeyConstraint('job_id', name=op.f('pk_job_runs')),
    sa.UniqueConstraint('idempotency_key', name=op.f('uq_job_runs_idempotency_key'))
    )
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        if op.get_bind().dialect.name == "mysql":
            # No partial index on MySQL: the status leads the scans' indexes, and a
            # generated column holds a singleton key while its job is processing.
            batch_op.create_index('ix_job_runs_status_last_activity', ['job_status', 'last_activity_at', 'job_id'], unique=False)
            batch_op.create_index('ix_job_runs_status_lease_expiry', ['job_status', 'lease_expires_at', 'job_id'], unique=False)
            batch_op.create_index('ix_job_runs_status_available', ['job_status', 'available_at', 'job_id'], unique=False)
            for statement in MYSQL_PROCESSING_SINGLETON:
                op.execute(statement)
        else:
            batch_op.create_index('ix_job_runs_processing_last_activity', ['last_activity_at', 'job_id'], unique=False, postgresql_where=sa.text("job_status = 'processing'"), sqlite_where=sa.text("job_status = 'processing'"))
            batch_op.create_index('ix_job_runs_processing_lease_expiry', ['lease_expires_at', 'job_id'], unique=False, postgresql_where=sa.text("job_status = 'processing'"), sqlite_where=sa.text("job_status = 'processing'"))
            batch_op.create_index('ix_job_runs_queued_available', ['available_at', 'job_id'], unique=False, postgresql_where=sa.text("job_status = 'queued'"), sqlite_where=sa.text("job_status = 'queued'"))
            batch_op.create_index('uq_job_runs_processing_singleton', ['singleton_key'], unique=True, postgresql_where=sa.text("job_status = 'processing'"), sqlite_where=sa.text("job_status = 'processing'"))
        batch_op.create_index('ix_job_runs_status_job', ['job_status', 'job_id'], unique=False)

    op.create_table('reconciler_leases',
    sa.Column('lease_name', sa.String(length=100), nullable=False),
    sa.Column('holder_id', sa.String(length=200), nullable=False),
    sa.Column('fencing_token', sa.BigInteger(), nullable=False),
    sa.Column('lease_expires_at', UtcDateTime(), nullable=False),
    sa.PrimaryKeyConstraint('lease_name', name=op.f('pk_reconciler_leases'))
    )
    op.create_table('reconciliation_passes',
    sa.Column('pass_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('reconciler_instance', sa.String(length=200), nullable=False),
    sa.Column('started_at', UtcDateTime(), nullable=False),
    sa.Column('finished_at', UtcDateTime(), nullable=True),
    sa.Column('candidates_seen', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('resumed_count', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('terminalized_count', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('skipped_count', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('pass_outcome', sa.String(length=16), nullable=True),
    sa.Column('error_code', sa.String(length=64), nullable=True),
    sa.CheckConstraint("pass_outcome IN ('ok', 'error', 'not_leader')", name=op.f('ck_reconciliation_passes_pass_outcome_known')),
    sa.PrimaryKeyConstraint('pass_id', name=op.f('pk_reconciliation_passes'))
    )
    with op.batch_alter_table('reconciliation_passes', schema=None) as batch_op:
        batch_op.create_index('ix_reconciliation_passes_started_at', ['started_at'], unique=False)

    op.create_table('job_attempts',
    sa.Column('job_id', sa.BigInteger(), nullable=False),
    sa.Column('claim_generation', sa.BigInteger(), nullable=False),
    sa.Column('attempt_number', sa.Integer(), nullable=False),
    sa.Column('lease_owner', sa.String(length=200), nullable=True),
    sa.Column('claimed_at', UtcDateTime(), nullable=False),
    sa.Column('ended_at', UtcDateTime(), nullable=True),
    sa.Column('attempt_outcome', sa.String(length=16), nullable=True),
    sa.Column('ended_by', sa.String(length=16), nullable=True),
    sa.CheckConstraint("attempt_outcome IN ('completed', 'failed', 'retrying', 'released', 'abandoned', 'lost')", name=op.f('ck_job_attempts_attempt_outcome_known')),
    sa.CheckConstraint("ended_by IN ('worker', 'reconciler', 'operator')", name=op.f('ck_job_attempts_ended_by_known')),
    sa.ForeignKeyConstraint(['job_id'], ['job_runs.job_id'], name=op.f('fk_job_attempts_job_id_job_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'claim_generation', name=op.f('pk_job_attempts'))
    )
    op.create_table('reconciliation_decisions',
    sa.Column('decision_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('pass_id', sa.BigInteger(), nullable=False),
    sa.Column('job_id', sa.BigInteger(), nullable=False),
    sa.Column('decided_at', UtcDateTime(), nullable=False),
    sa.Column('disposition', sa.String(length=16), nullable=False),
    sa.Column('decision_reason', sa.String(length=64), nullable=False),
    sa.Column('generation_before', sa.BigInteger(), nullable=True),
    sa.Column('generation_after', sa.BigInteger(), nullable=True),
    sa.Column('resume_step_index', sa.Integer(), nullable=True),
    sa.Column('decision_evidence', sa.JSON(), nullable=True),
    sa.CheckConstraint("disposition IN ('resume', 'terminalize', 'skip')", name=op.f('ck_reconciliation_decisions_disposition_known')),
    sa.ForeignKeyConstraint(['pass_id'], ['reconciliation_passes.pass_id'], name=op.f('fk_reconciliation_decisions_pass_id_reconciliation_passes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('decision_id', name=op.f('pk_reconciliation_decisions'))
    )
    with op.batch_alter_table('reconciliation_decisions', schema=None) as batch_op:
        batch_op.create_index('ix_reconciliation_decisions_decided_at', ['decided_at'], unique=False)
        batch_op.create_index('ix_reconciliation_decisions_job_id', ['job_id'], unique=False)
        batch_op.create_index('ix_reconciliation_decisions_pass_id', ['pass_id'], unique=False)
        batch_op.create_index('ix_reconciliation_decisions_reason_decision', ['decision_reason', 'decision_id'], unique=False)

    op.create_table('step_runs',
    sa.Column('job_id', sa.BigInteger(), nullable=False),
    sa.Column('step_index', sa.Integer(), nullable=False),
    sa.Column('step_name', sa.String(length=200), nullable=False),
    sa.Column('effect_kind', sa.String(length=16), nullable=False),
    sa.Column('step_state', sa.String(length=16), nullable=False),
    sa.Column('claim_generation', sa.BigInteger(), nullable=False),
    sa.Column('started_at', UtcDateTime(), nullable=False),
    sa.Column('finished_at', UtcDateTime(), nullable=True),
    sa.Column('error_code', sa.String(length=64), nullable=True),
    sa.Column('failure_retryable', sa.Boolean(), nullable=True),
    sa.CheckConstraint("effect_kind IN ('pure', 'idempotent', 'effectful')", name=op.f('ck_step_runs_effect_kind_known')),
    sa.CheckConstraint("step_state IN ('started', 'succeeded', 'failed', 'waiting')", name=op.f('ck_step_runs_step_state_known')),
    sa.ForeignKeyConstraint(['job_id'], ['job_runs.job_id'], name=op.f('fk_step_runs_job_id_job_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'step_index', name=op.f('pk_step_runs'))
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "mysql":
        # Each table's indexes go with it (MySQL refuses to drop one a foreign key needs).
        for table in ('step_runs', 'reconciliation_decisions', 'job_attempts',
                      'reconciliation_passes', 'reconciler_leases', 'job_runs'):
            op.drop_table(table)
        return
    op.drop_table('step_runs')
    with op.batch_alter_table('reconciliation_decisions', schema=None) as batch_op:
        batch_op.drop_index('ix_reconciliation_decisions_reason_decision')
        batch_op.drop_index('ix_reconciliation_decisions_pass_id')
        batch_op.drop_index('ix_reconciliation_decisions_job_id')
        batch_op.drop_index('ix_reconciliation_decisions_decided_at')

    op.drop_table('reconciliation_decisions')
    op.drop_table('job_attempts')
    with op.batch_alter_table('reconciliation_passes', schema=None) as batch_op:
        batch_op.drop_index('ix_reconciliation_passes_started_at')

    op.drop_table('reconciliation_passes')
    op.drop_table('reconciler_leases')
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.drop_index('uq_job_runs_processing_singleton', postgresql_where=sa.text("job_status = 'processing'"), sqlite_where=sa.text("job_status = 'processing'"))
        batch_op.drop_index('ix_job_runs_status_job')
        batch_op.drop_index('ix_job_runs_queued_available', postgresql_where=sa.text("job_status = 'queued'"), sqlite_where=sa.text("job_status = 'queued'"))
        batch_op.drop_index('ix_job_runs_processing_lease_expiry', postgresql_where=sa.text("job_status = 'processing'"), sqlite_where=sa.text("job_status = 'processing'"))
        batch_op.drop_index('ix_job_runs_processing_last_activity', postgresql_where=sa.text("job_status = 'processing'"), sqlite_where=sa.text("job_status = 'processing'"))

    op.drop_table('job_runs')
