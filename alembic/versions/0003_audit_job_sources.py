"""The audit names each decision's job source and keeps the job id as that source spells it.

Revision ID: 0003
Revises: 0002

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('reconciliation_decisions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('job_source', sa.String(length=32), server_default=sa.text("'native'"), nullable=False))
        batch_op.alter_column('job_id', existing_type=sa.BigInteger(), type_=sa.String(length=200), existing_nullable=False, postgresql_using='job_id::text')
        batch_op.drop_index('ix_reconciliation_decisions_job_id')
        batch_op.create_index('ix_reconciliation_decisions_source_job', ['job_source', 'job_id'], unique=False)


def downgrade() -> None:
    # Only this project's own jobs have integer ids; other sources' decisions cannot be
    # kept in the older shape.
    op.execute("DELETE FROM reconciliation_decisions WHERE job_source <> 'native'")
    with op.batch_alter_table('reconciliation_decisions', schema=None) as batch_op:
        batch_op.drop_index('ix_reconciliation_decisions_source_job')
        batch_op.create_index('ix_reconciliation_decisions_job_id', ['job_id'], unique=False)
        batch_op.alter_column('job_id', existing_type=sa.String(length=200), type_=sa.BigInteger(), existing_nullable=False, postgresql_using='job_id::bigint')
        batch_op.drop_column('job_source')
