"""The step ledger's own fence: each run of a job gets a number that only grows (issue 36).

Until this revision a ledger write was fenced on the attempt the job system passed, which
some systems never advance (an RQ job its own cleanup requeued runs under the same count)
and an operator's retry set back to 0 (so a paused worker of the ended run could write
again once the system counted from 1 anew). ``run_number`` is the ledger's: opening a run
takes the next one, and a pass's resume or terminalization and an operator's retry move it
on, so a write of any earlier run matches nothing. Rows written before this revision start
at 0; the next run of their job takes 1.

Revision ID: 0011
Revises: 0010

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = '0011'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('step_ledger_entries', schema=None) as batch_op:
        batch_op.add_column(sa.Column('run_number', sa.BigInteger(),
                                      server_default=sa.text('0'), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('step_ledger_entries', schema=None) as batch_op:
        batch_op.drop_column('run_number')
