"""A pass may end ``liveness_unknown``: it ran, but its source's liveness was not trusted.

Revision ID: 0008
Revises: 0007

"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CONSTRAINT = 'ck_reconciliation_passes_pass_outcome_known'
BEFORE = "pass_outcome IN ('ok', 'error', 'not_leader')"
AFTER = "pass_outcome IN ('ok', 'error', 'not_leader', 'liveness_unknown')"


def _outcomes(check: str) -> None:
    with op.batch_alter_table('reconciliation_passes', schema=None) as batch_op:
        batch_op.drop_constraint(op.f(CONSTRAINT), type_='check')
        batch_op.create_check_constraint(op.f(CONSTRAINT), check)


def upgrade() -> None:
    _outcomes(AFTER)


def downgrade() -> None:
    # Such a pass ran and recorded its decisions: in the older vocabulary it was ok.
    op.execute("UPDATE reconciliation_passes SET pass_outcome = 'ok' "
               "WHERE pass_outcome = 'liveness_unknown'")
    _outcomes(BEFORE)
