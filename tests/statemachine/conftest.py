"""The state machine's database: SQLite, or MariaDB where the tests' engines include it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.statemachine.harness import DATABASE, MACHINE_ENGINE


@pytest.fixture(autouse=True)
def machine_database(request: pytest.FixtureRequest) -> Iterator[None]:
    """On MariaDB (``harness.MACHINE_ENGINE``), one migrated database for the test, which
    ``DATABASE.engine`` empties for each run; on SQLite nothing (a file per run)."""
    if MACHINE_ENGINE != "mariadb":
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
