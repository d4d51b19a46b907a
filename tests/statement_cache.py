"""One compiled-statement cache for every engine the suite makes of one kind of database.

SQLAlchemy caches a statement's compiled SQL per engine, keyed on the engine's dialect
object. A long-lived reconciler has one engine and compiles each statement once; the suite
makes an engine per test database (hundreds per pytest worker), so each test compiled
every statement again: a sixth of the conformance suite's CPU, more under coverage's
tracer. ``share()`` makes each new engine use the dialect and cache of the first engine
made with the same driver and the same dialect-level arguments (pool and connection
arguments aside: they do not reach the dialect), as many connections of one engine would.
The engines still have their own pools, URLs and events. The servers are the same
binaries throughout a run, so the dialect's first-connect facts (server version, default
schema) hold for every engine that shares it.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.engine import create as engine_creation
from sqlalchemy.util import LRUCache

CACHE_SIZE = 5_000
"""Compiled statements kept per kind of engine: every test's, where one engine keeps 500."""

_NOT_THE_DIALECTS = frozenset({
    "connect_args", "creator", "echo", "echo_pool", "hide_parameters", "logging_name",
    "max_overflow", "pool", "pool_logging_name", "pool_pre_ping", "pool_recycle",
    "pool_reset_on_return", "pool_size", "pool_timeout", "pool_use_lifo", "poolclass"})
"""``create_engine`` arguments that configure the pool or the connection, not the dialect."""

_shared: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Any, LRUCache[Any, Any]]] = {}
_create_engine = engine_creation.create_engine


def _create_sharing(url: Any, **kwargs: Any) -> Engine:
    engine = _create_engine(url, **kwargs)
    if engine._compiled_cache is None:  # query_cache_size=0: the caller wants none
        return engine
    key = (engine.url.drivername,
           tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in _NOT_THE_DIALECTS)))
    dialect, cache = _shared.setdefault(key, (engine.dialect, LRUCache(CACHE_SIZE)))
    engine.dialect = dialect
    engine.pool._dialect = dialect
    engine._compiled_cache = cache
    return engine


def share() -> None:
    """From now on, engines made in this process share as above (once per process)."""
    if sa.create_engine is not _create_sharing:
        engine_creation.create_engine = _create_sharing
        sa.create_engine = _create_sharing
        sa.engine.create_engine = _create_sharing
