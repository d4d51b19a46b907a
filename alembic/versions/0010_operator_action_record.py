"""Operators act on every source (issue 27): the record says which, who and why.

``operator_actions`` keeps the source, the job's key as the source spells it, who acted,
their note, and the job's state before and after as the source reads it; the native job
id stays, NULL for a foreign job. Rows recorded before this revision were all native:
their source is ``native`` and their key the job id as text. ``operator_holds`` keeps the
reconciler's own hold on a foreign job, which its system has no place for.

Revision ID: 0010
Revises: 0009

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op
from models.base import UtcDateTime

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The lengths of ``reconciler.core.vocabulary`` as this revision was written.
SOURCE_MAX_LENGTH = 32
JOB_KEY_MAX_LENGTH = 200
ACTOR_MAX_LENGTH = 200
NOTE_MAX_LENGTH = 2000
STATE_MAX_LENGTH = 64


def upgrade() -> None:
    with op.batch_alter_table('operator_actions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('job_source', sa.String(length=SOURCE_MAX_LENGTH),
                                      server_default=sa.text("'native'"), nullable=False))
        batch_op.add_column(sa.Column('job_key', sa.String(length=JOB_KEY_MAX_LENGTH),
                                      nullable=True))
        batch_op.add_column(sa.Column('acted_by', sa.String(length=ACTOR_MAX_LENGTH),
                                      nullable=True))
        batch_op.add_column(sa.Column('operator_note', sa.String(length=NOTE_MAX_LENGTH),
                                      nullable=True))
        batch_op.add_column(sa.Column('state_before', sa.String(length=STATE_MAX_LENGTH),
                                      nullable=True))
        batch_op.add_column(sa.Column('state_after', sa.String(length=STATE_MAX_LENGTH),
                                      nullable=True))
        batch_op.alter_column('job_id', existing_type=sa.BigInteger(), nullable=True)
    actions = sa.table('operator_actions', sa.column('job_id', sa.BigInteger()),
                       sa.column('job_key', sa.String()),
                       sa.column('status_before', sa.String()),
                       sa.column('status_after', sa.String()),
                       sa.column('state_before', sa.String()),
                       sa.column('state_after', sa.String()))
    op.execute(actions.update().values(
        job_key=sa.cast(actions.c.job_id, sa.String(JOB_KEY_MAX_LENGTH)),
        state_before=actions.c.status_before, state_after=actions.c.status_after))
    with op.batch_alter_table('operator_actions', schema=None) as batch_op:
        batch_op.alter_column('job_key', existing_type=sa.String(length=JOB_KEY_MAX_LENGTH),
                              nullable=False)
        batch_op.create_index('ix_operator_actions_job_source_job_key',
                              ['job_source', 'job_key'], unique=False)
    op.create_table(
        'operator_holds',
        sa.Column('job_source', sa.String(length=SOURCE_MAX_LENGTH), nullable=False),
        sa.Column('job_key', sa.String(length=JOB_KEY_MAX_LENGTH), nullable=False),
        sa.Column('held_by', sa.String(length=ACTOR_MAX_LENGTH), nullable=True),
        sa.Column('held_at', UtcDateTime(), nullable=False),
        sa.PrimaryKeyConstraint('job_source', 'job_key', name=op.f('pk_operator_holds')),
    )


def downgrade() -> None:
    op.drop_table('operator_holds')
    # A foreign job's action has no native id to keep: the older schema cannot hold it.
    op.execute(sa.text("DELETE FROM operator_actions WHERE job_id IS NULL"))
    with op.batch_alter_table('operator_actions', schema=None) as batch_op:
        batch_op.drop_index('ix_operator_actions_job_source_job_key')
        batch_op.alter_column('job_id', existing_type=sa.BigInteger(), nullable=False)
        for column in ('state_after', 'state_before', 'operator_note', 'acted_by', 'job_key',
                       'job_source'):
            batch_op.drop_column(column)
