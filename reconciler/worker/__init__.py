"""The worker side, the public face of the lease contract (docs/lease-contract.md).

``from reconciler.worker import JobClient, Step, LeaseLost, Worker``: the client makes the
fenced writes, the runtime runs handlers under it. Nothing here decides a stale job's fate;
that is the reconciler's, in ``reconciler.core``.
"""

from reconciler.errors import LeaseLost
from reconciler.worker.client import Claim, JobClient, Step
from reconciler.worker.runtime import StepContext, Worker

__all__ = ["Claim", "JobClient", "LeaseLost", "Step", "StepContext", "Worker"]
