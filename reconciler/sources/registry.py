"""The source registry: every job source, declared once, in ``REGISTRY``.

Config parsing (``reconciler.config``: which ``[source]`` kinds exist and which keys each
takes), the composition root (how a source opens on a pass's connection), the command
line (how a job id is spelled, which operator commands a source takes) and the
conformance suite (which sources it must run, on which engines) all read this table.

Adding a source is:

1. **one module** under ``reconciler/sources/`` holding its config model (a
   ``reconciler.file_tables.SourceSettings`` dataclass: the ``[source]`` keys besides
   ``kind``, with its ``kind`` as a class variable), its fence snapshot (a frozen slotted
   ``reconciler.sources.kit.source.ForeignFence`` dataclass of what its swap repeats) and its
   class (a ``reconciler.sources.kit.source.ForeignSource``: the SQL of what runs, what
   expired, one swap, and ``listing``/``status_words`` for operators; opened as
   ``Class(connection, config, kinds, lock=...)``);
2. **one entry** below (and its import above it)::

       SourceEntry(
           config=MyConfig,              # its [source] model; MyConfig.kind is its name
           open=MySource,                # (connection, config, kinds, *, lock) -> JobSource
           job_key="integer",            # its job ids: "integer", "text" or "either"
           engines=POSTGRESQL,           # the engines it runs on
           capabilities=Capabilities(
               heartbeat=False,          # owner liveness of its own (worker heartbeats)
               error_field=True,         # our reason code lands in its own error field
               actions=frozenset(),      # operator commands: hold, unhold, retry, cancel
           ),
       )

3. **one conformance fixture** in ``tests/conformance`` (a ``RegisteredSource`` in its
   ``SOURCES``); a test fails while an entry has none.

No other module names a source kind (a test of the tree checks it): they ask here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as pydantic_dataclass
from sqlalchemy.engine import Connection

from reconciler.core.kinds import KindRules
from reconciler.core.ports import JobSource
from reconciler.core.vocabulary import JobKey, OperatorAction
from reconciler.file_tables import SourceSettings
from reconciler.sources.celery import CeleryConfig, CelerySource
from reconciler.sources.django_tasks import DjangoTasksConfig, DjangoTasksSource
from reconciler.sources.graphile_worker import GraphileWorkerConfig, GraphileWorkerSource
from reconciler.sources.pgboss import PgBossConfig, PgBossSource
from reconciler.sources.procrastinate import ProcrastinateConfig, ProcrastinateSource
from reconciler.sources.table import TableSource
from reconciler.sources.table.config import TableConfig
from reconciler.storage.native_kinds import kinded_native
from reconciler.storage.native_source import NativeSource

__all__ = [
    "REGISTRY", "SOURCES", "Capabilities", "CeleryConfig", "DjangoTasksConfig",
    "GraphileWorkerConfig", "NativeConfig", "PgBossConfig", "ProcrastinateConfig",
    "SourceEntry", "TableConfig", "entry_for", "entry_of", "integer_keyed", "is_native",
]

MAX_INTEGER_KEY = 2**63 - 1
"""The largest integer job id any source stores (a BIGINT)."""
POSTGRESQL = frozenset({"postgresql"})
EVERY_ENGINE = frozenset({"sqlite", "postgresql"})


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class NativeConfig(SourceSettings):
    """``kind = "native"``: this project's own ``job_runs`` (the default)."""

    kind: ClassVar[str] = NativeSource.source_name


KeyType = Literal["integer", "text", "either"]
"""How a source's job ids are spelled: whole numbers, text (a UUID), or as the mapped
column holds them (a number when written in digits, else text)."""


class Opener(Protocol):
    """How a source opens on one connection (the pass's transaction)."""

    def __call__(self, connection: Connection, config: Any, kinds: KindRules, *,
                 lock: bool) -> JobSource: ...


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a source's system lets the reconciler and its operators do."""

    heartbeat: bool
    """The system keeps owner liveness (worker heartbeats): a dead owner is seen at once."""
    error_field: bool
    """Our reason code is written where the system keeps a job's error."""
    actions: frozenset[OperatorAction]
    """The operator commands (``reconciler jobs hold|unhold|retry|cancel``) it takes."""

    @property
    def hold(self) -> bool:
        """Whether an operator can hold its jobs."""
        return OperatorAction.HOLD in self.actions


@dataclass(frozen=True, slots=True)
class SourceEntry:
    """One source: its config model, how it opens, its job keys, its capabilities."""

    config: type[SourceSettings]
    open: Opener
    job_key: KeyType
    engines: frozenset[str]
    capabilities: Capabilities

    @property
    def kind(self) -> str:
        """The source's name: its ``[source] kind`` and its name in the audit trail."""
        return self.config.kind

    def parse_job_key(self, text: str) -> JobKey:
        """A job id as this source spells it; ``ValueError`` naming the rule otherwise."""
        digits = text.isascii() and text.isdigit()
        if self.job_key == "text" or (self.job_key == "either" and not digits):
            if not text or len(text) > 200:
                raise ValueError(f"not a {self.kind} job id: {text!r}")
            return text
        if not digits or not 1 <= int(text) <= MAX_INTEGER_KEY:
            raise ValueError(f"not a {self.kind} job id: {text!r} (ids of {self.kind} jobs "
                             f"run from 1 to {MAX_INTEGER_KEY})")
        return int(text)


def _open_native(connection: Connection, config: Any, kinds: KindRules, *,
                 lock: bool) -> JobSource:
    return kinded_native(kinds)(connection, lock)


_NO_ACTIONS: frozenset[OperatorAction] = frozenset()

REGISTRY: tuple[SourceEntry, ...] = (
    SourceEntry(config=NativeConfig, open=_open_native, job_key="integer", engines=EVERY_ENGINE,
                capabilities=Capabilities(heartbeat=True, error_field=True,
                                          actions=frozenset(OperatorAction))),
    SourceEntry(config=ProcrastinateConfig, open=ProcrastinateSource, job_key="integer",
                engines=POSTGRESQL,
                capabilities=Capabilities(heartbeat=True, error_field=False,
                                          actions=_NO_ACTIONS)),
    SourceEntry(config=GraphileWorkerConfig, open=GraphileWorkerSource, job_key="integer",
                engines=POSTGRESQL,
                capabilities=Capabilities(heartbeat=False, error_field=True,
                                          actions=_NO_ACTIONS)),
    SourceEntry(config=PgBossConfig, open=PgBossSource, job_key="text", engines=POSTGRESQL,
                capabilities=Capabilities(heartbeat=False, error_field=True,
                                          actions=_NO_ACTIONS)),
    SourceEntry(config=TableConfig, open=TableSource, job_key="either", engines=EVERY_ENGINE,
                capabilities=Capabilities(heartbeat=False, error_field=True,
                                          actions=_NO_ACTIONS)),
    # Task ids are UUIDs; the backend keeps no heartbeat (a lease is max_run_seconds), and
    # our reason is the failed result's exception (its traceback's last line).
    SourceEntry(config=DjangoTasksConfig, open=DjangoTasksSource, job_key="text",
                engines=EVERY_ENGINE,
                capabilities=Capabilities(heartbeat=False, error_field=True,
                                          actions=_NO_ACTIONS)),
    # Liveness is its workers' answer to Celery's control ping over the broker; our reason
    # is the failed result's exception. On both engines its database result backend runs.
    SourceEntry(config=CeleryConfig, open=CelerySource, job_key="text", engines=EVERY_ENGINE,
                capabilities=Capabilities(heartbeat=True, error_field=True,
                                          actions=_NO_ACTIONS)),
)

SOURCES: dict[str, SourceEntry] = {entry.kind: entry for entry in REGISTRY}
"""Every entry by its kind, in ``REGISTRY`` order."""
DEFAULT_SOURCE = NativeConfig.kind


def entry_for(kind: str) -> SourceEntry:
    """The entry of a source kind (``KeyError`` for an unknown one)."""
    return SOURCES[kind]


def entry_of(config: SourceSettings) -> SourceEntry:
    """The entry a ``[source]`` config belongs to."""
    return SOURCES[config.kind]


def integer_keyed(kind: str) -> bool:
    """Whether a source's job ids are whole numbers (the audit keeps every id as text)."""
    entry = SOURCES.get(kind)
    return entry is not None and entry.job_key == "integer"


def is_native(config: SourceSettings) -> bool:
    """Whether the config names this project's own ``job_runs``."""
    return isinstance(config, NativeConfig)
