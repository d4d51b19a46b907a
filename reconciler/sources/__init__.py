"""Job sources beside the job systems teams already run (DESIGN.md section 9).

One module per system, each a class implementing the job-source port on one SQLAlchemy
connection (the pass's transaction; the foreign tables live in the reconciler's database):
``procrastinate``, ``graphile_worker``, ``pgboss`` and the mapped home-grown ``table``. The
native source (this project's ``job_runs``) lives in ``reconciler.storage``. docs/sources.md
says, per system, what counts as running, as liveness and as the fence, and what each swap
writes.
"""

from __future__ import annotations

from sqlalchemy.engine import Connection

from reconciler.config import (
    GraphileWorkerConfig,
    PgBossConfig,
    ProcrastinateConfig,
    SourceConfig,
    TableConfig,
)
from reconciler.core.kinds import KindRules
from reconciler.source_configs import CeleryConfig, DjangoTasksConfig
from reconciler.sources.base import ForeignSource
from reconciler.sources.celery import CelerySource
from reconciler.sources.django_tasks import DjangoTasksSource
from reconciler.sources.graphile_worker import GraphileWorkerSource
from reconciler.sources.pgboss import PgBossSource
from reconciler.sources.procrastinate import ProcrastinateSource
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


def open_foreign_source(connection: Connection, config: SourceConfig, kinds: KindRules, *,
                        lock: bool = True) -> ForeignSource:
    """The foreign source a ``[source]`` table names, bound to ``connection``.

    ``lock=False`` for dry runs and explain: candidates are read without row locks. The
    native source is not built here (``ValueError``): it is the store's.
    """
    if isinstance(config, ProcrastinateConfig):
        return ProcrastinateSource(connection, config, kinds, lock=lock)
    if isinstance(config, GraphileWorkerConfig):
        return GraphileWorkerSource(connection, config, kinds, lock=lock)
    if isinstance(config, PgBossConfig):
        return PgBossSource(connection, config, kinds, lock=lock)
    if isinstance(config, TableConfig):
        return TableSource(connection, config, kinds, lock=lock)
    if isinstance(config, DjangoTasksConfig):
        return DjangoTasksSource(connection, config, kinds, lock=lock)
    if isinstance(config, CeleryConfig):
        return CelerySource(connection, config, kinds, lock=lock)
    raise ValueError(f"source kind {config.kind!r} is not a foreign source")
