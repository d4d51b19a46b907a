"""Shadow decisions: a decision recorded by a pass in shadow mode, which changed nothing.

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


def upgrade() -> None:
    with op.batch_alter_table('reconciliation_decisions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('shadow_mode', sa.Boolean(), server_default=sa.text('false'), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('reconciliation_decisions', schema=None) as batch_op:
        batch_op.drop_column('shadow_mode')
