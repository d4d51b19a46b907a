"""A source as the registry finds it: its config model and how its system is declared.

Each system's package exports one ``Declaration`` (``DECLARATION``); the registry names
it by where it lives (``"reconciler.sources.<system>:DECLARATION"``). ``bind`` declares
the system from a config once (per process: a liveness it declares keeps what it saw
across passes there) and binds it anew to each transaction's connection, in the one kit
class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from sqlalchemy.engine import Connection

from reconciler.config.tables import SourceSettings
from reconciler.core.kinds import KindRules
from reconciler.sources.kit.source import DeclaredSource
from reconciler.sources.kit.system import System

ConfigT = TypeVar("ConfigT", bound=SourceSettings)
Opened = Callable[[Connection, bool], DeclaredSource]
"""A declared system, opened on one connection (``lock``: take the scans' row locks)."""


@dataclass(frozen=True, slots=True)
class Declaration(Generic[ConfigT]):
    """One foreign source: its ``[source]`` config model and its system, declared from a
    config alone (no database read)."""

    config: type[ConfigT]
    system: Callable[[ConfigT], System]

    @property
    def name(self) -> str:
        """Its ``[source]`` kind, and its name in the audit trail."""
        return self.config.kind

    def bind(self, config: SourceSettings, kinds: KindRules) -> Opened:
        """The system declared from ``config`` once, opened on each connection given."""
        if not isinstance(config, self.config):
            raise TypeError(f"source {self.name} declared from a {type(config).__name__}")
        system, name = self.system(config), self.name

        def opened(connection: Connection, lock: bool) -> DeclaredSource:
            return DeclaredSource(name, system, connection, kinds, lock=lock)

        return opened

    def open(self, connection: Connection, config: SourceSettings, kinds: KindRules, *,
             lock: bool = True) -> DeclaredSource:
        """The system declared from ``config``, bound to ``connection`` (a one-off: an
        operator's read, a start-up check)."""
        return self.bind(config, kinds)(connection, lock)
