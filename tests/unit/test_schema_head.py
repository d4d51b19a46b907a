"""The head revision the schema check uses without Alembic is the migration scripts' own."""

from __future__ import annotations

from reconciler.storage.schema import HEAD_REVISION, head_revision, scripts_head


def test_the_recorded_head_is_the_newest_migration_script() -> None:
    """Adding a migration without moving ``HEAD_REVISION`` fails here, not in production
    (where every database would be told to upgrade to the wrong revision)."""
    assert scripts_head() == HEAD_REVISION == head_revision()
