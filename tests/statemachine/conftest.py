"""The state machine's database: SQLite, or MariaDB for the tests that run there."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import ENGINES
from tests.statemachine.harness import DATABASE, DEFAULT_MACHINE_ENGINE


@pytest.fixture(autouse=True)
def machine_database(request: pytest.FixtureRequest) -> Iterator[None]:
    """On MariaDB (a class's ``machine_engine``, else ``harness.DEFAULT_MACHINE_ENGINE``),
    one migrated database for the test, which ``DATABASE.engine`` empties for each run; on
    SQLite nothing (a file per run). Skipped where the tests' engines leave it out."""
    engine = getattr(request.cls, "machine_engine", DEFAULT_MACHINE_ENGINE)
    if engine not in ENGINES:
        pytest.skip(f"the machine's engine {engine} is not among RECONCILER_TEST_ENGINES")
    if engine != "mariadb":
        yield
        return
    db = request.getfixturevalue("mariadb")
    name = db.new_database(migrated=True)
    DATABASE.mariadb_url = db.server.url(name)
    try:
        yield
    finally:
        DATABASE.mariadb_url = None
        db.server.drop_database(name)
