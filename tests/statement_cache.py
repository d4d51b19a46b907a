"""One compiled-statement cache for every engine the suite makes.

SQLAlchemy caches a statement's compiled SQL per engine, keyed on the engine's dialect
object. A long-lived reconciler has one engine and compiles each statement once; the suite
makes an engine per test database (hundreds per pytest worker), so each test compiled
every statement again: half the state machine's CPU on SQLite under coverage's tracer.

``share()`` gives every engine made afterwards in this process one cache, in which the
dialect's place in each key is taken by what the dialect compiles with: its class and
every plain value it holds (the server's version and quoting as its first connection
learnt them, the parameter style, the identifier limits...), and the identity of every
function it was given (a JSON serializer). Two engines whose dialects agree on all of that
compile a statement alike, so the second finds the first's; dialects that differ in any of
it never meet. Each engine keeps its own dialect, pool and events: a PostgreSQL engine's
``do_connect`` listener, which gives that engine's connections its own timeouts, is a
dialect event, and a shared dialect would have given every engine the first one's.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any
from weakref import WeakKeyDictionary

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.engine import create as engine_creation
from sqlalchemy.util import LRUCache

CACHE_SIZE = 20_000
"""Compiled statements kept for the whole process, where one engine keeps 500."""

_PLAIN = (bool, int, float, str, bytes, type(None))

_GIVEN_FUNCTIONS = ("_json_serializer", "_json_deserializer")
"""The functions ``create_engine`` hands a dialect that its compiled statements' bind and
result processors call; its other callables are its own memoized methods."""


def _compiles_with(dialect: Any) -> Hashable:
    """What ``dialect`` compiles a statement with, as a key."""
    held = []
    for name, value in sorted(vars(dialect).items()):
        if isinstance(value, _PLAIN) or (
                isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
            held.append((name, value))
        elif name in _GIVEN_FUNCTIONS:
            held.append((name, id(value)))
    return type(dialect), tuple(held)


class _DialectKeyedCache(LRUCache[Any, Any]):
    """SQLAlchemy's ``(dialect, statement key, ...)`` keys, the dialect replaced by what
    it compiles with once its first connection has run (before that, by itself, as
    SQLAlchemy keys it)."""

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(self._key(key), default)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(self._key(key), value)

    @staticmethod
    def _key(key: Any) -> Any:
        if isinstance(key, tuple) and key and isinstance(key[0], sa.engine.Dialect):
            found = _fingerprints.get(key[0])
            if found is not None:
                return (found, *key[1:])
        return key


_fingerprints: WeakKeyDictionary[Any, Hashable] = WeakKeyDictionary()
"""Each initialized dialect's ``_compiles_with``, taken once: a dialect adds attributes
lazily as it is used (a ping's setting), and a fingerprint that followed them would miss
its own statements."""
_cache = _DialectKeyedCache(CACHE_SIZE)
_create_engine = engine_creation.create_engine


def _create_sharing(url: Any, **kwargs: Any) -> Engine:
    engine = _create_engine(url, **kwargs)
    if engine._compiled_cache is None:  # query_cache_size=0: the caller wants none
        return engine
    engine._compiled_cache = _cache
    dialect = engine.dialect

    # After the dialect's own first-connect listener (registered before this one), which
    # initializes it from the server.
    @sa.event.listens_for(engine.pool, "connect", once=True)
    def _initialized(*_: Any) -> None:
        _fingerprints.setdefault(dialect, _compiles_with(dialect))

    return engine


def share() -> None:
    """From now on, engines made in this process share one cache as above."""
    if sa.create_engine is not _create_sharing:
        engine_creation.create_engine = _create_sharing
        sa.create_engine = _create_sharing
        sa.engine.create_engine = _create_sharing
