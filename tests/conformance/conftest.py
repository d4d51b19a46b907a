"""Runs the suite against every registered source, on every engine the source runs on.

Which sources exist and which engines each runs on is the source registry's
(``reconciler.config.registry``); a new source plugs in here by adding its
``RegisteredSource`` (its fixture) to ``SOURCES``, and ``test_registry_coverage`` fails
while a registered source has none. Its fixture is
opened on a fresh migrated database of each engine it runs on, as every other integration
test's (``shared`` sources: on the session's database holding the real system's schema).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.config.registry import entry_for
from tests.conformance.celery import CELERY, CELERY_DJANGO
from tests.conformance.django_tasks import DJANGO_TASKS
from tests.conformance.dramatiq import DRAMATIQ
from tests.conformance.fixtures import RegisteredSource, SourceFixture
from tests.conformance.native import NATIVE
from tests.conformance.rq import RQ
from tests.conformance.systems import GRAPHILE_WORKER, PG_BOSS, PROCRASTINATE
from tests.conformance.table import TABLE
from tests.conftest import ENGINES, MariaDBForTests, PostgresForTests
from tests.helpers import fresh_database
from tests.pg_server import INSTALL_HINT
from tests.sources.celery_support import (  # noqa: F401 - fixtures, found by name
    celery_live_worker,
    django_celery_results_mariadb_schema,
    django_celery_results_schema,
    django_celery_sqlite_template,
    redis_server,
    redis_url,
)

# The real systems' session fixtures (their schemas installed once, emptied per test).
from tests.sources.conftest import (  # noqa: F401 - fixtures, found by name
    graphile_db,
    graphile_schema,
    mariadb_sources_db,
    node_modules,
    pgboss_db,
    pgboss_schema,
    procrastinate_db,
    procrastinate_schema,
    sources_db,
)
from tests.sources.django_tasks_support import (  # noqa: F401 - fixtures, found by name
    django_sqlite_template,
    django_tasks_mariadb_schema,
    django_tasks_schema,
)

SOURCES: tuple[RegisteredSource, ...] = (NATIVE, TABLE, PROCRASTINATE, GRAPHILE_WORKER,
                                         PG_BOSS, DJANGO_TASKS, CELERY, CELERY_DJANGO, RQ,
                                         DRAMATIQ)


DIALECTS = {"mariadb": "mysql"}
"""The registry's engine (a dialect name) of a test engine other than by that name: the
throwaway MariaDB is the ``mysql`` dialect's."""


def dialect_of(engine: str) -> str:
    """The registry's name of a test engine (``ENGINES``)."""
    return DIALECTS.get(engine, engine)


CASES = [(registered, engine) for registered in SOURCES for engine in ENGINES
         if dialect_of(engine) in entry_for(registered.name).engines]
"""Every source on every engine it runs on (no case for an engine a source never uses)."""


@pytest.fixture(params=CASES, ids=lambda case: f"{case[0].label or case[0].name}-{case[1]}")
def source(request: pytest.FixtureRequest, tmp_path: Path,
           postgres: PostgresForTests | None) -> Iterator[SourceFixture]:
    """The source under test: on a fresh migrated database of one engine, or (a real
    system's schema, installed once) on the session's shared database, emptied."""
    registered, engine = request.param
    if engine == "postgresql" and postgres is None:
        pytest.skip(f"PostgreSQL not available: {INSTALL_HINT}")
    if registered.shared:
        with registered.open(request) as fixture:
            yield fixture
        return
    if engine == "sqlite":
        with registered.open(fresh_database(tmp_path)) as fixture:
            yield fixture
        return
    if engine == "mariadb":
        mariadb: MariaDBForTests = request.getfixturevalue("mariadb")
        name = mariadb.new_database(migrated=True)
        try:
            with registered.open(mariadb.server.url(name)) as fixture:
                yield fixture
        finally:
            mariadb.server.drop_database(name)
        return
    assert postgres is not None
    name = postgres.new_database(migrated=True)
    try:
        with registered.open(postgres.url(name)) as fixture:
            yield fixture
    finally:
        postgres.drop(name)
