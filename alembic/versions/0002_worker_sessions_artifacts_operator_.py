"""Worker sessions, staged artifacts and operator actions; claims record their session.

Revision ID: 0002
Revises: 0001

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from models.base import UtcDateTime

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('operator_actions',
    sa.Column('action_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.BigInteger(), nullable=False),
    sa.Column('operator_action', sa.String(length=16), nullable=False),
    sa.Column('action_outcome', sa.String(length=16), nullable=False),
    sa.Column('refusal_reason', sa.String(length=64), nullable=True),
    sa.Column('acted_at', UtcDateTime(), nullable=False),
    sa.Column('status_before', sa.String(length=16), nullable=True),
    sa.Column('status_after', sa.String(length=16), nullable=True),
    sa.Column('generation_before', sa.BigInteger(), nullable=True),
    sa.Column('generation_after', sa.BigInteger(), nullable=True),
    sa.CheckConstraint("action_outcome IN ('applied', 'refused')", name=op.f('ck_operator_actions_action_outcome_known')),
    sa.CheckConstraint("operator_action IN ('hold', 'unhold', 'retry', 'cancel')", name=op.f('ck_operator_actions_operator_action_known')),
    sa.PrimaryKeyConstraint('action_id', name=op.f('pk_operator_actions'))
    )
    with op.batch_alter_table('operator_actions', schema=None) as batch_op:
        batch_op.create_index('ix_operator_actions_job_id', ['job_id'], unique=False)

    op.create_table('worker_sessions',
    sa.Column('session_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('worker_name', sa.String(length=200), nullable=False),
    sa.Column('host_name', sa.String(length=200), nullable=False),
    sa.Column('process_id', sa.Integer(), nullable=False),
    sa.Column('started_at', UtcDateTime(), nullable=False),
    sa.Column('heartbeat_at', UtcDateTime(), nullable=False),
    sa.Column('stopped_at', UtcDateTime(), nullable=True),
    sa.Column('stop_reason', sa.String(length=16), nullable=True),
    sa.CheckConstraint("stop_reason IN ('stopped', 'replaced', 'heartbeat_lost')", name=op.f('ck_worker_sessions_stop_reason_known')),
    sa.PrimaryKeyConstraint('session_id', name=op.f('pk_worker_sessions'))
    )
    with op.batch_alter_table('worker_sessions', schema=None) as batch_op:
        if op.get_bind().dialect.name == "mysql":  # no partial index: live sessions first
            batch_op.create_index('ix_worker_sessions_stopped_heartbeat', ['stopped_at', 'heartbeat_at'], unique=False)
        else:
            batch_op.create_index('ix_worker_sessions_live_heartbeat', ['heartbeat_at'], unique=False, postgresql_where=sa.text('stopped_at IS NULL'), sqlite_where=sa.text('stopped_at IS NULL'))
        batch_op.create_index('ix_worker_sessions_live_identity', ['worker_name', 'host_name'], unique=False, postgresql_where=sa.text('stopped_at IS NULL'), sqlite_where=sa.text('stopped_at IS NULL'))

    op.create_table('job_artifacts',
    sa.Column('job_id', sa.BigInteger(), nullable=False),
    sa.Column('claim_generation', sa.BigInteger(), nullable=False),
    sa.Column('artifact_name', sa.String(length=200), nullable=False),
    sa.Column('artifact_state', sa.String(length=16), nullable=False),
    sa.Column('staged_at', UtcDateTime(), nullable=False),
    sa.Column('settled_at', UtcDateTime(), nullable=True),
    sa.CheckConstraint("artifact_state IN ('staged', 'published', 'discarded')", name=op.f('ck_job_artifacts_artifact_state_known')),
    sa.ForeignKeyConstraint(['job_id'], ['job_runs.job_id'], name=op.f('fk_job_artifacts_job_id_job_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'claim_generation', 'artifact_name', name=op.f('pk_job_artifacts'))
    )
    with op.batch_alter_table('job_artifacts', schema=None) as batch_op:
        batch_op.create_index('ix_job_artifacts_staged_job', ['job_id', 'claim_generation'], unique=False, postgresql_where=sa.text("artifact_state = 'staged'"), sqlite_where=sa.text("artifact_state = 'staged'"))

    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('worker_session_id', sa.BigInteger(), nullable=True))
        batch_op.create_index('ix_job_runs_processing_session', ['worker_session_id'], unique=False, postgresql_where=sa.text("job_status = 'processing'"), sqlite_where=sa.text("job_status = 'processing'"))



def downgrade() -> None:
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.drop_index('ix_job_runs_processing_session', postgresql_where=sa.text("job_status = 'processing'"), sqlite_where=sa.text("job_status = 'processing'"))
        batch_op.drop_column('worker_session_id')

    with op.batch_alter_table('job_artifacts', schema=None) as batch_op:
        batch_op.drop_index('ix_job_artifacts_staged_job', postgresql_where=sa.text("artifact_state = 'staged'"), sqlite_where=sa.text("artifact_state = 'staged'"))

    op.drop_table('job_artifacts')
    with op.batch_alter_table('worker_sessions', schema=None) as batch_op:
        batch_op.drop_index('ix_worker_sessions_live_identity', postgresql_where=sa.text('stopped_at IS NULL'), sqlite_where=sa.text('stopped_at IS NULL'))
        if op.get_bind().dialect.name == "mysql":
            batch_op.drop_index('ix_worker_sessions_stopped_heartbeat')
        else:
            batch_op.drop_index('ix_worker_sessions_live_heartbeat', postgresql_where=sa.text('stopped_at IS NULL'), sqlite_where=sa.text('stopped_at IS NULL'))

    op.drop_table('worker_sessions')
    with op.batch_alter_table('operator_actions', schema=None) as batch_op:
        batch_op.drop_index('ix_operator_actions_job_id')

    op.drop_table('operator_actions')
