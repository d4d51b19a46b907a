"""A worker's, producer's or step ledger's parts: an engine with the settings' timeouts,
checked to be at this release's schema.

Built for the public constructors ``JobClient(...)`` and ``StepLedger(...)`` through their
narrow factory, ``reconciler.connect``; nothing in the worker package imports this module.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from sqlalchemy.engine import Connection, Engine

from reconciler.config.loader import load_config
from reconciler.config.settings import Settings
from reconciler.core.worker_ports import WorkerStore, WorkWaiter
from reconciler.storage.engines import DatabaseTimeouts, create_engine
from reconciler.storage.schema import require_current
from reconciler.storage.sql_store import SqlStore
from reconciler.storage.step_ledger import LedgerRun, StepLedger
from reconciler.storage.wakeups import NotifyWaiter

__all__ = ["Database", "LedgerRun", "ProducerConnection", "StepLedger", "WorkerParts",
           "assemble_worker", "open_step_ledger"]

Database: TypeAlias = str | Engine
"""What a public constructor is given: a database URL, or an engine used as it is."""
ProducerConnection: TypeAlias = Connection
"""A producer's own transaction, which ``JobClient.enqueue(connection=)`` writes in."""


@dataclass(frozen=True, slots=True)
class WorkerParts:
    """What a ``JobClient`` works with: an engine with the settings' timeouts, checked."""

    settings: Settings
    engine: Engine
    """Producers may enqueue in a transaction of their own on it (``connection=``)."""
    store: WorkerStore
    work_waiter: Callable[[threading.Event], WorkWaiter]
    """What an idle worker waits on: LISTEN/NOTIFY on PostgreSQL, polling elsewhere."""
    owns_engine: bool
    """Whether the engine was opened here (from a URL) and is to be disposed of."""


def assemble_worker(database: Database | None = None, *,
                    settings: Settings | None = None) -> WorkerParts:
    """A worker's or producer's parts: ``database`` (a URL, or an engine used as it is),
    else the database the config names (``RECONCILER_CONFIG``, ``RECONCILER_<SETTING>``);
    ``settings``, else the config's.

    With a URL, the engine carries the settings' timeouts: a database that stops
    answering fails a heartbeat instead of holding the lease thread forever.
    """
    settings = settings or load_config().settings
    if isinstance(database, Engine):
        engine, owned = database, False
    else:
        engine = create_engine(database or settings.database_url,
                               timeouts=DatabaseTimeouts.from_settings(settings),
                               must_exist=True)
        owned = True
    try:
        require_current(engine)
    except BaseException:
        if owned:
            engine.dispose()
        raise

    def waiter(interrupt: threading.Event) -> WorkWaiter:
        return NotifyWaiter(engine, interrupt)

    return WorkerParts(settings, engine, SqlStore(engine), waiter, owned)


def open_step_ledger(database: Database | None = None) -> StepLedger:
    """The step ledger's store on ``database`` (a URL or an engine), else on the database
    the config names (``RECONCILER_CONFIG``, ``RECONCILER_<SETTING>``), with its
    timeouts."""
    if database is None:
        settings = load_config().settings
        return StepLedger(settings.database_url,
                          timeouts=DatabaseTimeouts.from_settings(settings))
    return StepLedger(database)
