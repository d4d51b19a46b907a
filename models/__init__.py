"""The reconciler's schema: typed SQLAlchemy models and the metadata Alembic migrates."""

from models.base import NAMING_CONVENTION, Base, UtcDateTime, compared_on
from models.ledger import StepLedgerEntry
from models.tables import (
    JobArtifact,
    JobAttempt,
    JobRun,
    OperatorAction,
    OperatorHold,
    ReconcilerLease,
    ReconciliationDecision,
    ReconciliationPass,
    StepRun,
    WorkerSession,
)

metadata = Base.metadata

__all__ = [
    "NAMING_CONVENTION",
    "Base",
    "JobArtifact",
    "JobAttempt",
    "JobRun",
    "OperatorAction",
    "OperatorHold",
    "ReconcilerLease",
    "ReconciliationDecision",
    "ReconciliationPass",
    "StepLedgerEntry",
    "StepRun",
    "UtcDateTime",
    "WorkerSession",
    "compared_on",
    "metadata",
]
