"""Migrations run in-process, and the start-up check that the schema is at head."""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from alembic import command
from reconciler.errors import DatabaseUnavailableError, SchemaOutOfDateError

UPGRADE_LOCK = 0x5C0A11  # an advisory lock key of our own, held while migrating


def _script_location() -> Path:
    # A wheel carries the migrations inside the package; a checkout keeps them at the root.
    package = Path(__file__).resolve().parents[1]
    packaged = package / "migrations"
    if (packaged / "env.py").exists():
        return packaged
    return package.parent / "alembic"


def alembic_config() -> Config:
    """An Alembic config pointing at the migrations, with no ini file needed."""
    config = Config()
    config.set_main_option("script_location", str(_script_location()))
    return config


def head_revision() -> str:
    """The newest migration this code knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:  # pragma: no cover - the package always ships migrations
        raise SchemaOutOfDateError("no migrations found in this installation")
    return head


def current_revision(engine: Engine) -> str | None:
    """The database's migration revision, or None for an empty database."""
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except (OperationalError, DBAPIError) as exc:
        raise DatabaseUnavailableError(describe_connection_error(engine, exc)) from None


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply migrations on one shared connection (no second engine, no ini file)."""
    config = alembic_config()
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                # Replicas started together upgrade one at a time; the others find it done.
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": UPGRADE_LOCK})
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
    except (OperationalError, DBAPIError) as exc:
        raise DatabaseUnavailableError(describe_connection_error(engine, exc)) from None


def downgrade(engine: Engine, revision: str = "base") -> None:
    """Undo migrations down to ``revision``."""
    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, revision)


def require_current(engine: Engine) -> None:
    """Refuse to work on a database whose schema is not at this code's head."""
    current, head = current_revision(engine), head_revision()
    if current == head:
        return
    if current is None:
        raise SchemaOutOfDateError(
            "the database has no reconciler schema; run `reconciler db upgrade` first")
    raise SchemaOutOfDateError(
        f"the database schema is at revision {current}, this version needs {head}; "
        "run `reconciler db upgrade`")


def describe_connection_error(engine: Engine, exc: Exception) -> str:
    """One line naming the database (password hidden) and the driver's first line."""
    detail = str(getattr(exc, "orig", exc)).strip().splitlines()
    first = detail[0] if detail else type(exc).__name__
    url = engine.url.render_as_string(hide_password=True)
    return f"cannot reach the database at {url}: {first}"
