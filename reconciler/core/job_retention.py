"""The port of the job-retention chore: this project's finished jobs deleted with their
rows, by the leader, in bounded batches (implemented by ``storage.retention``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RetentionReport:
    """What one job-retention run deleted over all its batches."""

    jobs_deleted: int
    rows_deleted: int
    batches: int


class JobRetention(Protocol):
    """Deletes this project's finished jobs with their rows (a chore of the leader)."""

    def delete_finished_jobs(self, days: float, batch_jobs: int,
                             max_batches: int) -> RetentionReport:
        """Jobs finished more than ``days`` ago, ``batch_jobs`` per transaction, at most
        ``max_batches`` transactions."""
