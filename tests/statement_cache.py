"""One compiled-statement cache for the SQLite engines the suite makes.

SQLAlchemy caches a statement's compiled SQL per engine, keyed on the engine's dialect
object. A long-lived reconciler has one engine and compiles each statement once; the suite
makes an engine per test database (hundreds per pytest worker), so each test compiled
every statement again: half the state machine's CPU on SQLite under coverage's tracer.
``share()`` makes each new SQLite engine use the dialect and cache of an earlier one made
with the same dialect-level arguments (pool and connection arguments aside: they do not
reach the dialect), as many connections of one engine would. The engines keep their own
pools, files and pool events.

Only SQLite, and only a dialect already initialized by its first connection: its facts
are the SQLite library's, the same for every file. PostgreSQL's engines register a
``do_connect`` listener, a dialect event, with each engine's own timeouts, so a shared
dialect would connect every engine with the first one's; MySQL's dialect learns the
server's character set and quoting at its first connection.
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
    if engine.dialect.name != "sqlite" or engine._compiled_cache is None:
        return engine  # query_cache_size=0: the caller wants no cache
    key = (engine.url.drivername,
           tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in _NOT_THE_DIALECTS)))
    shared = _shared.get(key)
    if shared is None or shared[0].server_version_info is None:
        # None initialized yet (no engine of this kind has connected): this one's
        # dialect is the candidate, and the cache is shared already (keyed on dialects).
        cache = shared[1] if shared is not None else LRUCache(CACHE_SIZE)
        _shared[key] = (engine.dialect, cache)
        engine._compiled_cache = cache
        return engine
    engine.dialect, engine._compiled_cache = shared
    engine.pool._dialect = shared[0]
    return engine


def share() -> None:
    """From now on, SQLite engines made in this process share as above."""
    if sa.create_engine is not _create_sharing:
        engine_creation.create_engine = _create_sharing
        sa.create_engine = _create_sharing
        sa.engine.create_engine = _create_sharing
