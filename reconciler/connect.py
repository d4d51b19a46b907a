"""The library's entry point into the composition root: the narrow factory of the public
constructors ``JobClient(...)`` and ``StepLedger(...)``.

A worker's, producer's or task's process has no command line: ``from reconciler.worker
import JobClient`` and ``from reconciler.ledger import StepLedger`` are where it enters.
Their constructors are built through the two functions here (and typed by the two aliases),
so the worker package and the ledger never import the root themselves;
``tests/unit/test_architecture.py`` lists this module among the root's few importers.
"""

from __future__ import annotations

from reconciler.root.worker import (
    Database,
    LedgerRun,
    ProducerConnection,
    StepLedger,
    WorkerParts,
    assemble_worker,
    open_step_ledger,
)

__all__ = ["Database", "LedgerRun", "ProducerConnection", "StepLedger", "WorkerParts",
           "assemble_worker", "open_step_ledger"]
