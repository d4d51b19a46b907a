"""Alembic environment: shares the caller's connection when one is given (CLI, tests);
run by hand (``alembic upgrade head``), it migrates the database the reconciler's config
names, read by the same loader as the command line (``reconciler.root.migrations``)."""

from __future__ import annotations

from sqlalchemy.engine import Connection

from alembic import context
from models import metadata
from reconciler.root.migrations import migration_engine

config = context.config


# MySQL's processing-singleton column and its unique index stand for the partial index
# of the other engines (models.tables.MYSQL_PROCESSING_SINGLETON): not compared there.
MYSQL_ONLY = {"processing_singleton_key", "uq_job_runs_processing_singleton"}


def _compared_on_mysql(_object: object, name: str | None, _type: str, _reflected: bool,
                       _compare_to: object) -> bool:
    return name not in MYSQL_ONLY


def run_on(connection: Connection) -> None:
    mysql = connection.dialect.name == "mysql"
    context.configure(
        connection=connection,
        target_metadata=metadata,
        # SQLite cannot ALTER most things in place; batch mode copies the table.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_object=_compared_on_mysql if mysql else None,
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
