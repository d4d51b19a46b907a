"""The artifact sweep, a sidecar chore: discard staged sets that can never publish (their
attempt is over) and finish moves that a worker's crash interrupted after completion."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from reconciler.core.worker_ports import ArtifactRecords
from reconciler.worker.artifacts import move_published, staging_path

log = logging.getLogger("reconciler.sidecar.artifact_sweep")


@dataclass(frozen=True, slots=True)
class SweepResult:
    """What one sweep did; failures are retried by the next sweep."""

    discarded: int
    settled: int
    failures: int


def sweep_artifacts(store: ArtifactRecords, root: Path, limit: int = 500) -> SweepResult:
    """Delete and discard staged sets that can never publish; finish interrupted moves."""
    discarded = settled = failures = 0
    for job_id, generation, name in store.unpublishable_artifacts(limit):
        try:
            staging_path(root, job_id, generation, name).unlink(missing_ok=True)
            if store.discard_artifact(job_id, generation, name):
                discarded += 1
        except (OSError, ValueError) as exc:
            failures += 1
            log.warning("event=artifact_sweep_failed job_id=%s error=%s", job_id,
                        type(exc).__name__)
    for job_id, generation, _name in store.unsettled_published_artifacts(limit):
        try:
            move_published(store, root, job_id, generation)
            settled += 1
        except (OSError, ValueError) as exc:
            failures += 1
            log.warning("event=artifact_settle_failed job_id=%s error=%s", job_id,
                        type(exc).__name__)
    return SweepResult(discarded, settled, failures)
