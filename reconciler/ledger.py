"""The step ledger: step-level resume for tasks of a foreign job system.

A Procrastinate task (or a worker of a home-grown job table) records its steps here, in
the reconciler's own database::

    from reconciler.ledger import StepLedger, Step
    ledger = StepLedger(database_url)    # or StepLedger(): the database the config names
    run = ledger.run("procrastinate", job_id, attempt, [Step("fetch", "idempotent"),
                     Step("charge", "effectful")])
    for i in run.pending():          # steps not yet succeeded, in order
        with run.step(i):            # started, then succeeded (failed on an exception)
            ...

``attempt`` is the job system's own attempt counter for this run, as the job carries it
(Procrastinate ``context.job.attempts``, graphile-worker ``job.attempts``, pg-boss
``retryCount``, a home-grown table's attempts column): a run of an older attempt than one
already opened is refused. The source of that system then reads these records as the
job's steps, so a run the reconciler finds dead is judged step by step, and a re-run skips
the steps that succeeded.

Every write is fenced on the run, not on the attempt: each run that opens takes the job's
next run number, and so do the reconciler's resume or terminalization and an operator's
retry, so a write of any earlier run raises ``LeaseLost`` and records nothing, whatever
attempt the job system gives the next run.

A run never gets back an effectful step that an earlier run started and never finished:
its effect may have happened. When the job system runs the job again by itself (its own
retry, expiry or redelivery, which no decision allowed), opening the run raises
``EffectInDoubt`` (a ``LeaseLost``) naming the step; the reconciler's pass ends the job
``worker_died_mid_step``, and an operator who checked the effect can retry it, which lets
the step run again. A pure or idempotent step is handed back: running it again is safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from reconciler.connect import Database, LedgerRun, open_step_ledger
from reconciler.core.evidence import PlanStep
from reconciler.core.vocabulary import JobKey
from reconciler.errors import EffectInDoubt, LeaseLost

Step = PlanStep
"""One step of a run's plan: ``Step("fetch", "idempotent")``."""

__all__ = ["EffectInDoubt", "LeaseLost", "LedgerRun", "Step", "StepLedger"]


class StepLedger:
    """The step ledger on ``database`` (a URL or a SQLAlchemy engine), else on the database
    the config names (``RECONCILER_CONFIG``, ``RECONCILER_<SETTING>``), with its timeouts.

    Its store is assembled by the composition root (``reconciler.connect``), as a
    ``JobClient``'s is."""

    __slots__ = ("_store",)

    def __init__(self, database: Database | None = None) -> None:
        self._store = open_step_ledger(database)

    def run(self, source_name: str, job_id: JobKey, attempt: int,
            steps: Sequence[PlanStep]) -> LedgerRun:
        """Open the run of ``attempt`` of a job: its plan recorded, earlier attempts fenced.

        Raises ``EffectInDoubt`` when an effectful step an earlier run started never
        finished and no decision released it, ``LeaseLost`` when a later attempt of the job
        has opened its run already (or the reconciler ended this one), and ``ValueError``
        when the plan contradicts the one recorded for the job by an earlier attempt.
        """
        return self._store.run(source_name, job_id, attempt, steps)

    def close(self) -> None:
        """Dispose of the engine this ledger created (not of one it was given)."""
        self._store.close()

    def __enter__(self) -> StepLedger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
