"""The step ledger's table: steps recorded by tasks of a foreign job system."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Boolean, CheckConstraint, Integer, String, text
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base
from models.tables import EFFECT_KINDS, one_of
from reconciler.core.vocabulary import StepState

# A ledger step is never "waiting": gates are this project's own workers' business.
LEDGER_STEP_STATES = (StepState.STARTED, StepState.SUCCEEDED, StepState.FAILED)


class StepLedgerEntry(Base):
    """One step of one foreign job, as the job's task recorded it through the step ledger.

    A job's rows are written together when a run opens (one per step of its plan, with no
    state until the step starts). ``attempt_number`` is the job system's attempt that holds
    the job's ledger: a run of an older attempt is refused. ``run_number`` is the ledger's
    own fence, the same on every row of a job: each run that opens takes the next one, and
    the reconciler's resume or terminalization and an operator's retry move it on, so a
    reclaimed run's late writes match no row and record nothing, whatever attempt the job
    system gives the next run.
    """

    __tablename__ = "step_ledger_entries"

    source_name: Mapped[str] = mapped_column(String(32), primary_key=True)
    # The job's id as its system spells it (an integer's decimal text, or a UUID).
    job_key: Mapped[str] = mapped_column(String(200), primary_key=True)
    step_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    step_name: Mapped[str] = mapped_column(String(200))
    effect_kind: Mapped[str] = mapped_column(String(16))
    step_state: Mapped[str | None] = mapped_column(String(16))
    failure_retryable: Mapped[bool | None] = mapped_column(Boolean)
    attempt_number: Mapped[int] = mapped_column(BigInteger)
    run_number: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    updated_at: Mapped[datetime]

    __table_args__ = (
        CheckConstraint(one_of("step_state", LEDGER_STEP_STATES), name="step_state_known"),
        CheckConstraint(one_of("effect_kind", EFFECT_KINDS), name="effect_kind_known"),
        CheckConstraint("step_index >= 0", name="step_index_not_negative"),
    )
