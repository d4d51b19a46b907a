"""The operator desk over the configured source, for the command line and the sidecar's
console: the native desk on this project's tables, or a foreign source's desk over its
system's actions (``reconciler/sources/<package>/actions.py``, ``open_actions``)."""

from __future__ import annotations

import importlib

from sqlalchemy.engine import Engine

from reconciler.config.loader import Config
from reconciler.config.registry import is_native
from reconciler.core.operator_desk import ActionCounter, OperatorDesk, not_counted
from reconciler.sources.kit.actions import ActionsOpener, ForeignDesk
from reconciler.storage.desks import NativeDesk
from reconciler.storage.operator import OperatorSql

__all__ = ["open_desk"]


def open_desk(engine: Engine, config: Config, store: OperatorSql,
              counted: ActionCounter = not_counted) -> OperatorDesk | None:
    """The desk over ``config``'s source on ``engine`` (``store``: this project's tables
    on it), each action counted by ``counted``; None for a source that takes no action.
    Only the configured source's actions module is imported."""
    entry = config.source_entry
    if not entry.capabilities.actions:
        return None
    if is_native(config.source):
        return NativeDesk(engine, store, counted)
    module = importlib.import_module(f"{entry.module}.actions")
    opener: ActionsOpener = module.open_actions
    return ForeignDesk(engine, entry.kind, config.source, config.kinds, opener=opener,
                       parse_key=entry.parse_job_key, counted=counted)
