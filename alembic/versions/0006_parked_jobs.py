"""Parked jobs: held or gated jobs, once recorded, leave the candidate scans (issue 13).

The two scan indexes are rebuilt with the parked rows left out, so 10,000 held or gated
jobs cost a quiet pass nothing.

Revision ID: 0006
Revises: 0005

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PROCESSING = sa.text("job_status = 'processing'")
SCANNED = sa.text("job_status = 'processing' AND NOT reconcile_parked")
SCAN_INDEXES = (("ix_job_runs_processing_lease_expiry", "lease_expires_at"),
                ("ix_job_runs_processing_last_activity", "last_activity_at"))


def _scan_indexes(batch_op: object, where: sa.TextClause, name: str) -> None:
    column = dict(SCAN_INDEXES)[name]
    batch_op.create_index(  # type: ignore[attr-defined]
        name, [column, 'job_id'], unique=False, postgresql_where=where, sqlite_where=where)


def _partial() -> bool:
    """MySQL's scan indexes have no predicate to change (no partial index there)."""
    return op.get_bind().dialect.name != "mysql"


def upgrade() -> None:
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('reconcile_parked', sa.Boolean(),
                                      server_default=sa.text('false'), nullable=False))
        for name, _ in SCAN_INDEXES if _partial() else ():
            batch_op.drop_index(name)
            _scan_indexes(batch_op, SCANNED, name)


def downgrade() -> None:
    with op.batch_alter_table('job_runs', schema=None) as batch_op:
        for name, _ in SCAN_INDEXES if _partial() else ():
            batch_op.drop_index(name)
            _scan_indexes(batch_op, PROCESSING, name)
        batch_op.drop_column('reconcile_parked')
