"""The one composition root: engines, stores and the pass's job source, built from settings.

Nothing else in the package imports a concrete storage adapter (a test of the import
graph keeps it so): the CLI, the sidecar and the worker client ask here, and get back
objects typed by the ports they use.
"""

from __future__ import annotations

import threading

from sqlalchemy.engine import Engine

from reconciler.core.passes import PassConfig
from reconciler.core.ports import PassStore
from reconciler.core.worker_ports import WorkWaiter
from reconciler.settings import Settings
from reconciler.storage.engines import create_engine
from reconciler.storage.retention import JobRetentionSql
from reconciler.storage.schema import require_current, upgrade
from reconciler.storage.sql_store import SqlStore
from reconciler.storage.step_ledger import LedgerRun, StepLedger
from reconciler.storage.wakeups import NotifyWaiter

__all__ = [
    # The step ledger is public API (reconciler.ledger); its store is handed out from here.
    "LedgerRun", "StepLedger", "check_schema", "open_engine", "open_job_retention",
    "open_pass_store", "open_store", "pass_config", "upgrade_schema", "work_waiter",
]


def open_engine(database: str | Engine) -> Engine:
    """An engine for a database URL (an engine is passed through)."""
    return create_engine(database) if isinstance(database, str) else database


def check_schema(engine: Engine) -> None:
    """Refuse an unreachable database or one whose schema is not at this release's head."""
    require_current(engine)


def open_job_retention(engine: Engine) -> JobRetentionSql:
    """Retention of finished jobs in this project's own tables (a sidecar chore)."""
    return JobRetentionSql(engine)


def upgrade_schema(engine: Engine) -> None:
    """Apply this project's migrations (and only its own tables)."""
    upgrade(engine)


def open_store(engine: Engine) -> SqlStore:
    """Every operation on this project's own tables: claims, sessions, artifacts, operator
    actions, read views, and passes over the native source."""
    return SqlStore(engine)


def open_pass_store(engine: Engine) -> PassStore:
    """Where passes read and apply: the configured job source with the audit and lease."""
    return SqlStore(engine)


def work_waiter(engine: Engine, interrupt: threading.Event) -> WorkWaiter:
    """What an idle worker waits on: LISTEN/NOTIFY on PostgreSQL, polling elsewhere."""
    return NotifyWaiter(engine, interrupt)


def pass_config(settings: Settings, instance: str) -> PassConfig:
    """The pass configuration these settings give an instance."""
    return PassConfig(
        batch_size=settings.batch_size,
        thresholds=settings.thresholds(),
        instance=instance,
        session_timeout_seconds=settings.session_timeout_seconds,
        shadow=settings.shadow,
        brake=settings.brake_limits(),
    )
