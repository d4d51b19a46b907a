"""Runs the suite against every registered source, on every engine the source runs on.

A new source plugs in by adding its ``RegisteredSource`` to ``SOURCES``; its fixture is
opened on the same migrated databases (``db_url``: SQLite and PostgreSQL) as every other
integration test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.engine import make_url

from tests.conformance.fixtures import RegisteredSource, SourceFixture
from tests.conformance.native import NATIVE
from tests.conformance.systems import GRAPHILE_WORKER, PG_BOSS, PROCRASTINATE
from tests.conformance.table import TABLE

# The real systems' session fixtures (their schemas installed once, emptied per test).
from tests.sources.conftest import (  # noqa: F401 - fixtures, found by name
    graphile_db,
    graphile_schema,
    node_modules,
    pgboss_db,
    pgboss_schema,
    procrastinate_db,
    procrastinate_schema,
    sources_db,
)

SOURCES: tuple[RegisteredSource, ...] = (NATIVE, TABLE, PROCRASTINATE, GRAPHILE_WORKER,
                                         PG_BOSS)


@pytest.fixture(params=SOURCES, ids=lambda registered: registered.name)
def source(request: pytest.FixtureRequest, db_url: str) -> Iterator[SourceFixture]:
    """The source under test on a fresh migrated database of one engine."""
    registered: RegisteredSource = request.param
    engine_name = make_url(db_url).get_backend_name()
    if engine_name not in registered.engines:
        pytest.skip(f"{registered.name} does not run on {engine_name}")
    with registered.open(request if registered.shared else db_url) as fixture:
        yield fixture
