"""The source registry: every job source, declared once, in ``REGISTRY``, as plain data.

Config parsing (``reconciler.config.loader``: which ``[source]`` kinds exist and which keys
each takes), the composition root (how a source opens on a pass's connection), the
command line and the console (how a job id is spelled, which operator commands a source
takes) and the conformance suite (which sources it must run, on which engines) all read
this table.

An entry is a lazy declaration: a name and where its package is (``"module:Name"``),
never an import. Reading the registry imports no adapter, no database driver and no
validation library, so ``reconciler --help`` stays fast, the config, the views and the
console read it freely, and a command imports only the source it is configured with
(``SourceEntry.config_model`` and ``SourceEntry.bind`` import it when first asked).

Adding a source is (docs/architecture.md, "Adding a source", has the checklist):

1. **one package** under ``reconciler/sources/`` holding its config model (a
   ``reconciler.config.tables.SourceSettings`` dataclass: the ``[source]`` keys besides
   ``kind``, with its ``kind`` as a class variable), its fence snapshot (a frozen slotted
   ``reconciler.sources.kit.fences.ForeignFence`` dataclass of what its swap repeats) and
   its ``DECLARATION`` (a ``reconciler.sources.kit.declaration.Declaration``: its config
   model and the function declaring its ``System`` from a config: its shape, the SQL of
   what runs, what expired, one swap, and its listing for operators);
2. **one entry** below::

       SourceEntry(
           kind="my-system",             # its [source] kind; MyConfig.kind says the same
           config="reconciler.sources.my_system:MyConfig",
           source="reconciler.sources.my_system:DECLARATION",
           job_key="integer",            # its job ids: "integer", "text" or "either"
           engines=POSTGRESQL,           # the engines it runs on
           capabilities=Capabilities(
               heartbeat=False,          # owner liveness of its own (worker heartbeats)
               error_field=True,         # our reason code lands in its own error field
               actions=frozenset(),      # operator commands: hold, unhold, retry, cancel
           ),
           extra="my-system",            # the pyproject extra of the packages it imports
           imports=("my_client",),       # beyond the base install, and their import names
       )                                 # (else omit both)

   A source that imports packages beyond the base install lists them as an extra in
   ``pyproject.toml`` and names it in ``extra``, and their top-level import names in
   ``imports``: a config naming the source without them installed is then one line saying
   which extra to install (a ``ConfigError``).
3. **one conformance fixture** in ``tests/conformance`` (a ``RegisteredSource`` in its
   ``SOURCES``); a test fails while an entry has none.

No other module names a source kind (a test of the tree checks it): they ask here. A unit
test checks each entry against the classes it names.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast, runtime_checkable

from reconciler.core.vocabulary import JobKey, OperatorAction
from reconciler.errors import ConfigError

if TYPE_CHECKING:
    # Types only: reading the registry imports nothing but the vocabulary.
    from reconciler.config.tables import SourceSettings
    from reconciler.core.kinds import KindRules
    from reconciler.core.ports import JobSource

__all__ = [
    "DEFAULT_SOURCE", "ENGINE_NAMES", "EVERY_ENGINE", "POSTGRESQL", "REGISTRY", "SOURCES",
    "Bound",
    "Capabilities", "Declared", "KeyType", "Opener", "SourceEntry", "entry_for", "entry_of",
    "integer_keyed", "is_native",
]

MAX_INTEGER_KEY = 2**63 - 1
"""The largest integer job id any source stores (a BIGINT)."""
POSTGRESQL = frozenset({"postgresql"})
EVERY_ENGINE = frozenset({"sqlite", "postgresql", "mysql"})
ENGINE_NAMES = {"sqlite": "SQLite", "postgresql": "PostgreSQL", "mysql": "MySQL or MariaDB"}
"""An engine (a SQLAlchemy dialect's name) as a refusal names it."""

KeyType = Literal["integer", "text", "either"]
"""How a source's job ids are spelled: whole numbers, text (a UUID), or as the mapped
column holds them (a number when written in digits, else text)."""


Bound = Callable[[Any, bool], "JobSource"]
"""A source declared for one process, opened on each transaction's connection (a
SQLAlchemy ``Connection``, typed loosely here so that the registry imports no driver)
with or without the scans' row locks."""


@runtime_checkable
class Declared(Protocol):
    """A foreign source's declaration (``reconciler.sources.kit.declaration``)."""

    def bind(self, config: Any, kinds: KindRules) -> Bound:
        """Its system declared from ``config`` once, opened per transaction."""


class Opener(Protocol):
    """How the native source opens on one connection (the pass's transaction)."""

    def __call__(self, connection: Any, config: Any, kinds: KindRules, *,
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


OWN_PACKAGES = frozenset({"reconciler", "models"})
"""This project's top-level packages: a module of ours missing is a bug, never an extra."""
DISTRIBUTION = "stale-claim-reconciler"


def _load(path: str) -> Any:
    """The object ``"package.module:Name"`` names, its module imported now."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True, slots=True)
class SourceEntry:
    """One source: its kind, where its config model and its class live, its job keys, its
    engines and its capabilities."""

    kind: str
    """The source's name: its ``[source] kind`` and its name in the audit trail."""
    config: str
    """Its config model, ``"module:Name"``."""
    source: str
    """Its declaration (a foreign source's ``DECLARATION``), or what opens it on a
    connection (the native source's function), ``"module:Name"``."""
    job_key: KeyType
    engines: frozenset[str]
    capabilities: Capabilities
    extra: str | None = None
    """The extra of this project that brings the packages its source imports in the
    sidecar (``pip install 'stale-claim-reconciler[EXTRA]'``, pyproject's
    ``optional-dependencies``); None when the base install has them all."""
    imports: tuple[str, ...] = ()
    """The top-level packages of its extra that its source imports, found (never
    imported) before its module is: one missing is one line naming the extra, at config
    load, however late the source imports it."""

    @property
    def module(self) -> str:
        """The module its source lives in (the one a command configured with it imports)."""
        return self.source.partition(":")[0]

    def config_model(self) -> type[SourceSettings]:
        """Its config model (importing its module); a ``ConfigError`` naming its extra
        when a package that extra brings is not installed."""
        return cast("type[SourceSettings]", self._load(self.config))

    def declared(self) -> Declared | Opener:
        """Its declaration or opener (importing its module); a ``ConfigError`` naming its
        extra when a package that extra brings is not installed."""
        return cast("Declared | Opener", self._load(self.source))

    def _load(self, path: str) -> Any:
        for package in self.imports:
            if importlib.util.find_spec(package) is None:
                raise self._missing(package)
        try:
            return _load(path)
        except ModuleNotFoundError as err:
            package = (err.name or "").partition(".")[0]
            # Only a third-party package is the user's to install (one the source imports
            # without declaring it, its extra's dependencies): one of our own modules
            # missing, or any package of a source that needs no extra, is a bug or a broken
            # install, and keeps its traceback.
            if self.extra is None or not package or package in OWN_PACKAGES:
                raise
            raise self._missing(package) from None

    def _missing(self, package: str) -> ConfigError:
        return ConfigError(f"the {self.kind} source needs the package {package!r}, which is "
                           f"not installed: pip install '{DISTRIBUTION}[{self.extra}]'")

    def bind(self, config: Any, kinds: KindRules) -> Bound:
        """The source declared from ``config`` once (for a process: what its declared
        liveness remembers lives as long), opened on each connection given."""
        target = self.declared()
        if isinstance(target, Declared):
            return target.bind(config, kinds)
        opener = target

        def opened(connection: Any, lock: bool) -> JobSource:
            return opener(connection, config, kinds, lock=lock)

        return opened

    def open(self, connection: Any, config: Any, kinds: KindRules, *,
             lock: bool) -> JobSource:
        """The source bound to ``connection`` (a one-off: a check, an operator's read)."""
        return self.bind(config, kinds)(connection, lock)

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



REGISTRY: tuple[SourceEntry, ...] = (
    SourceEntry(kind="native", config="reconciler.config.tables:NativeConfig",
                source="reconciler.storage.native_kinds:open_native", job_key="integer",
                engines=EVERY_ENGINE,
                capabilities=Capabilities(heartbeat=True, error_field=True,
                                          actions=frozenset(OperatorAction))),
    SourceEntry(kind="procrastinate",
                config="reconciler.sources.procrastinate:ProcrastinateConfig",
                source="reconciler.sources.procrastinate:DECLARATION",
                job_key="integer", engines=POSTGRESQL,
                capabilities=Capabilities(heartbeat=True, error_field=False,
                                          actions=frozenset(OperatorAction))),
    SourceEntry(kind="graphile-worker",
                config="reconciler.sources.graphile_worker:GraphileWorkerConfig",
                source="reconciler.sources.graphile_worker:DECLARATION",
                job_key="integer", engines=POSTGRESQL,
                capabilities=Capabilities(heartbeat=False, error_field=True,
                                          actions=frozenset(OperatorAction))),
    SourceEntry(kind="pg-boss", config="reconciler.sources.pgboss:PgBossConfig",
                source="reconciler.sources.pgboss:DECLARATION", job_key="text",
                engines=POSTGRESQL,
                capabilities=Capabilities(heartbeat=False, error_field=True,
                                          actions=frozenset(OperatorAction))),
    SourceEntry(kind="table", config="reconciler.sources.table.config:TableConfig",
                source="reconciler.sources.table:DECLARATION", job_key="either",
                engines=EVERY_ENGINE,
                capabilities=Capabilities(heartbeat=False, error_field=True,
                                          actions=frozenset(OperatorAction))),
    # Task ids are UUIDs; the backend keeps no heartbeat (a lease is max_run_seconds), and
    # our reason is the failed result's exception (its traceback's last line).
    SourceEntry(kind="django-tasks",
                config="reconciler.sources.django_tasks:DjangoTasksConfig",
                source="reconciler.sources.django_tasks:DECLARATION", job_key="text",
                engines=EVERY_ENGINE,
                capabilities=Capabilities(heartbeat=False, error_field=True,
                                          actions=frozenset(OperatorAction))),
    # Liveness is its workers' answer to Celery's control ping over the broker; our reason
    # is the failed result's exception. On every engine its database result backend runs.
    SourceEntry(kind="celery", config="reconciler.sources.celery:CeleryConfig",
                source="reconciler.sources.celery:DECLARATION", job_key="text",
                engines=EVERY_ENGINE,
                capabilities=Capabilities(heartbeat=True, error_field=True,
                                          actions=frozenset(OperatorAction)),
                extra="celery", imports=("celery", "redis")),
    # Liveness is the started registry's expiry and its workers' keys in Redis; our
    # reason is the failed job's exc_info and latest result. The reconciler's own tables
    # stay on any engine (database_url), Redis is the second store.
    SourceEntry(kind="rq", config="reconciler.sources.rq:RqConfig",
                source="reconciler.sources.rq:DECLARATION", job_key="text",
                engines=EVERY_ENGINE,
                capabilities=Capabilities(heartbeat=True, error_field=True,
                                          actions=frozenset(OperatorAction)),
                extra="rq", imports=("rq", "redis")),
    # Liveness is each worker process's heartbeat in Redis, timed on Redis's clock; which
    # fetched message started is the app's middleware's mark; our reason is the dead
    # letter's options and the failed result. The reconciler's tables stay on any engine.
    SourceEntry(kind="dramatiq", config="reconciler.sources.dramatiq:DramatiqConfig",
                source="reconciler.sources.dramatiq:DECLARATION", job_key="text",
                engines=EVERY_ENGINE,
                capabilities=Capabilities(heartbeat=True, error_field=True,
                                          actions=frozenset(OperatorAction)),
                extra="dramatiq", imports=("redis",)),
)

SOURCES: dict[str, SourceEntry] = {entry.kind: entry for entry in REGISTRY}
"""Every entry by its kind, in ``REGISTRY`` order."""
DEFAULT_SOURCE = REGISTRY[0].kind
"""The source of a config without ``[source]``: this project's own ``job_runs``."""


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
    return config.kind == DEFAULT_SOURCE
