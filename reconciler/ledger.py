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
``retryCount``, a home-grown table's attempts column): it only has to grow from one run of
a job to the next. The source of that system then reads these records as the job's steps,
so a run the reconciler finds dead is judged step by step, and a re-run skips the steps
that succeeded.

Every write is fenced on the attempt: once a later attempt has opened its run, or the
reconciler has resumed or terminalized the job, a write of the earlier run raises
``LeaseLost`` and records nothing.
"""

from reconciler.core.evidence import PlanStep
from reconciler.errors import LeaseLost
from reconciler.wiring import LedgerRun, StepLedger

Step = PlanStep
"""One step of a run's plan: ``Step("fetch", "idempotent")``."""

__all__ = ["LeaseLost", "LedgerRun", "Step", "StepLedger"]
