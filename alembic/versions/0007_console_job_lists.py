"""The operator console's lists of held and parked jobs: partial indexes on the few rows.

Revision ID: 0007
Revises: 0006

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = (("ix_job_runs_held_job", sa.text("operator_hold")),
           ("ix_job_runs_parked_job", sa.text("reconcile_parked")))


def upgrade() -> None:
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        for name, where in INDEXES:
            batch_op.create_index(name, ['job_id'], unique=False, postgresql_where=where,
                                  sqlite_where=where)


def downgrade() -> None:
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        for name, _ in INDEXES:
            batch_op.drop_index(name)
