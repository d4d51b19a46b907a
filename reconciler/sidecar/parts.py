"""What ``reconciler run`` works with: its parts, typed by their ports.

The composition root (``reconciler.root.sidecar``) builds them; the sidecar's ``Service``
takes them and opens nothing, so its tick, readiness and overrun logic run in unit tests
without a database. Nothing here knows a database driver: how a database error reads (a
bounded code, one redacted line) is handed in with the parts too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from reconciler.config.settings import Settings
from reconciler.console import Console
from reconciler.core.job_retention import JobRetention
from reconciler.core.operator_desk import ActionCounter
from reconciler.core.passes import PassConfig
from reconciler.core.ports import PassStore
from reconciler.core.vocabulary import DatabaseErrorCode
from reconciler.core.worker_ports import ArtifactRecords


@dataclass(frozen=True, slots=True)
class DatabaseCheck:
    """What ``/readyz`` asks of the database, on an engine of its own with short timeouts:
    the start-up's schema and source check, again."""

    run: Callable[[], None]
    """Raise (a ``ReconcilerError`` naming it) unless the database is ready."""
    close: Callable[[], None]
    """Release the check's engine."""


@dataclass(frozen=True, slots=True)
class ErrorReading:
    """How a database error reads in the sidecar's logs, metrics and ``/readyz``."""

    code: Callable[[BaseException], DatabaseErrorCode]
    """Its bounded code (``code=`` of a log line, the ``code`` label of a metric)."""
    line: Callable[[BaseException], str]
    """The driver's first line of it, passwords hidden, bounded in length."""


@dataclass(frozen=True, slots=True)
class SidecarParts:
    """What ``reconciler run`` works with: one engine whose sessions carry the pass
    timeouts, one store on it, and the probe's own engine."""

    settings: Settings
    instance: str
    """This replica's name in the audit trail and the leader lease."""
    pass_config: PassConfig
    passes: PassStore
    """The configured ``[source]`` with the audit and the lease."""
    artifacts: ArtifactRecords
    """This project's artifact records (the sweep's), on the same store."""
    job_retention: JobRetention
    database_check: DatabaseCheck
    errors: ErrorReading
    console: Callable[[ActionCounter], Console] | None
    """Opens the operator console, given the counter of its operators' actions (None:
    ``console = false``); the console closes its own engine."""
    close: Callable[[], None]
    """Release the engine (the probe and the console close their own)."""
