"""Alembic environment: shares the caller's connection when one is given (CLI, tests);
run by hand (``alembic upgrade head``), it migrates the database the reconciler's config
names, read by the same loader as the command line (``reconciler.root.migrations``)."""

from __future__ import annotations

from sqlalchemy.engine import Connection

from alembic import context
from models import compared_on, metadata
from reconciler.root.migrations import migration_engine

config = context.config


def run_on(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        # SQLite cannot ALTER most things in place; batch mode copies the table.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_object=compared_on(connection.dialect.name),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    shared = config.attributes.get("connection")
    if shared is not None:
        run_on(shared)
        return
    engine = migration_engine()
    try:
        with engine.connect() as connection:
            run_on(connection)
            connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run against a database")
run_migrations_online()
