"""What a foreign source shows operators (``reconciler jobs``, ``reconciler kinds``, the
console's job page): its jobs as its system lists them, their statuses in this project's
words, their order, and the running jobs no pass can judge. ``ForeignSource`` is one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from reconciler.core.ports import JobKey, Unjudged
from reconciler.core.vocabulary import JobStatus


class SourceListing(ABC):
    """A foreign system's jobs as operators see them, read on the source's connection."""

    @abstractmethod
    def listing(self) -> sa.Select[Any]:
        """Every job of the system, for operators (``reconciler jobs list|show``), with
        these columns labelled: ``job_id``, ``job_kind``, ``source_status`` (the system's
        own word), ``attempts`` (used, the running one included), ``max_attempts`` (NULL:
        the kind's), ``reason`` (where our reason code may be written, else NULL),
        ``created_at`` and ``updated_at`` (NULL where the system keeps none)."""

    @abstractmethod
    def status_words(self) -> Mapping[str, JobStatus]:
        """The system's statuses (``source_status``) in this project's words."""

    def listing_order(self, jobs: sa.Subquery) -> list[sa.ColumnElement[Any]]:
        """The order of ``jobs list`` over ``listing()`` as the subquery ``jobs``: newest
        first, by creation where the system keeps it, else by id (which grows with each
        new job in the systems that keep no creation time)."""
        return [jobs.c.created_at.desc().nulls_last(), jobs.c.job_id.desc()]

    def unjudged(self, job_id: JobKey | None = None) -> Unjudged | None:
        """Running jobs (``job_id``: only that one) whose rows lack what a pass reads, so
        that no pass can judge them; None by default (every running row is judged)."""
        return None
