"""The step ledger: steps recorded by tasks of a foreign job system (issue 11).

Revision ID: 0004
Revises: 0003

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from models.base import UtcDateTime

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('step_ledger_entries',
    sa.Column('source_name', sa.String(length=32), nullable=False),
    sa.Column('job_key', sa.String(length=200), nullable=False),
    sa.Column('step_index', sa.Integer(), nullable=False),
    sa.Column('step_name', sa.String(length=200), nullable=False),
    sa.Column('effect_kind', sa.String(length=16), nullable=False),
    sa.Column('step_state', sa.String(length=16), nullable=True),
    sa.Column('failure_retryable', sa.Boolean(), nullable=True),
    sa.Column('attempt_number', sa.BigInteger(), nullable=False),
    sa.Column('started_at', UtcDateTime(), nullable=True),
    sa.Column('finished_at', UtcDateTime(), nullable=True),
    sa.Column('updated_at', UtcDateTime(), nullable=False),
    sa.CheckConstraint("effect_kind IN ('pure', 'idempotent', 'effectful')", name=op.f('ck_step_ledger_entries_effect_kind_known')),
    sa.CheckConstraint("step_state IN ('started', 'succeeded', 'failed')", name=op.f('ck_step_ledger_entries_step_state_known')),
    sa.CheckConstraint('step_index >= 0', name=op.f('ck_step_ledger_entries_step_index_not_negative')),
    sa.PrimaryKeyConstraint('source_name', 'job_key', 'step_index', name=op.f('pk_step_ledger_entries'))
    )


def downgrade() -> None:
    op.drop_table('step_ledger_entries')
