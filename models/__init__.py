"""The reconciler's schema: typed SQLAlchemy models and the metadata Alembic migrates."""

from models.base import NAMING_CONVENTION, Base, UtcDateTime
from models.tables import (
    JobAttempt,
    JobRun,
    ReconcilerLease,
    ReconciliationDecision,
    ReconciliationPass,
    StepRun,
)

metadata = Base.metadata

__all__ = [
    "NAMING_CONVENTION",
    "Base",
    "JobAttempt",
    "JobRun",
    "ReconcilerLease",
    "ReconciliationDecision",
    "ReconciliationPass",
    "StepRun",
    "UtcDateTime",
    "metadata",
]
