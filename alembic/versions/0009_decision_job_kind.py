"""Each decision keeps its job's kind, as the source read it (issue 25).

A foreign system's kinds live in its own tables (a Celery task name, a pg-boss queue): the
console's kind column and filter had nothing to read for its decisions. Recorded beside
each decision, the kind also outlives the job it names, as the rest of the audit does.
Decisions recorded before this revision keep NULL (a native job's kind is still read from
``job_runs`` for those).

Revision ID: 0009
Revises: 0008

"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RECORDED_KIND_MAX_LENGTH = 255
"""``reconciler.core.vocabulary.RECORDED_KIND_MAX_LENGTH`` as this revision was written."""


def upgrade() -> None:
    with op.batch_alter_table('reconciliation_decisions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('job_kind', sa.String(length=RECORDED_KIND_MAX_LENGTH),
                                      nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('reconciliation_decisions', schema=None) as batch_op:
        batch_op.drop_column('job_kind')
