"""Job sources beside the job systems teams already run (docs/sources.md).

One package per system, each declaring its ``[source]`` config model, its fence snapshot
and its shape over one SQLAlchemy connection (the pass's transaction; the foreign tables
live in the reconciler's database): ``procrastinate``, ``graphile_worker``, ``pgboss``,
``django_tasks``, ``celery`` and the mapped home-grown ``table``. What they share (the
scans, batches, swaps' fences, the step ledger around them) is written once in ``kit``.
The native source (this project's ``job_runs``) lives in ``reconciler.storage``.
``reconciler.sources.registry`` lists every source once: adding one is a package, an
entry there and a conformance fixture (docs/architecture.md, "Adding a source").
"""

from __future__ import annotations

from sqlalchemy.engine import Connection

from reconciler.core.kinds import KindRules
from reconciler.file_tables import SourceSettings
from reconciler.sources.celery import CelerySource
from reconciler.sources.django_tasks import DjangoTasksSource
from reconciler.sources.graphile_worker import GraphileWorkerSource
from reconciler.sources.kit.source import ForeignSource
from reconciler.sources.pgboss import PgBossSource
from reconciler.sources.procrastinate import ProcrastinateSource
from reconciler.sources.registry import entry_of, is_native
from reconciler.sources.table import TableSource

__all__ = [
    "CelerySource",
    "DjangoTasksSource",
    "ForeignSource",
    "GraphileWorkerSource",
    "PgBossSource",
    "ProcrastinateSource",
    "TableSource",
    "open_foreign_source",
]


def open_foreign_source(connection: Connection, config: SourceSettings, kinds: KindRules, *,
                        lock: bool = True) -> ForeignSource:
    """The foreign source a ``[source]`` table names, bound to ``connection``.

    ``lock=False`` for dry runs and explain: candidates are read without row locks. The
    native source is not built here (``ValueError``): it is the store's.
    """
    if is_native(config):
        raise ValueError(f"source kind {config.kind!r} is not a foreign source")
    source = entry_of(config).open(connection, config, kinds, lock=lock)
    if not isinstance(source, ForeignSource):  # pragma: no cover - a registry mistake
        raise TypeError(f"source kind {config.kind!r} opens no ForeignSource")
    return source
