"""Job retention's index on finished jobs; shadow decisions in the audit (issue 13).

Revision ID: 0005
Revises: 0004

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FINISHED = sa.text("finished_at IS NOT NULL")


def upgrade() -> None:
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.create_index('ix_job_runs_finished_at', ['finished_at', 'job_id'],
                              unique=False, postgresql_where=FINISHED, sqlite_where=FINISHED)
    with op.batch_alter_table('reconciliation_decisions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('shadow_mode', sa.Boolean(),
                                      server_default=sa.text('false'), nullable=False))
        batch_op.create_index('ix_reconciliation_decisions_shadow_mode_decision',
                              ['shadow_mode', 'decision_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('reconciliation_decisions', schema=None) as batch_op:
        batch_op.drop_index('ix_reconciliation_decisions_shadow_mode_decision')
        batch_op.drop_column('shadow_mode')
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.drop_index('ix_job_runs_finished_at', postgresql_where=FINISHED,
                            sqlite_where=FINISHED)
