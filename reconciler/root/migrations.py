"""``reconciler db upgrade`` and ``alembic``: this project's migrations, from the one config.

``alembic/env.py`` takes its engine from here (``migration_engine``), so ``alembic upgrade
head`` run by hand reads the same config file, environment and URL rules as the command
line does.
"""

from __future__ import annotations

from sqlalchemy.engine import Engine

from reconciler.config.loader import Config, load_config
from reconciler.root.checks import check_source
from reconciler.storage.engines import (
    UNLIMITED_TIMEOUTS,
    DatabaseTimeouts,
    create_engine,
    display_url,
)
from reconciler.storage.schema import head_revision, upgrade

__all__ = ["migrate", "migration_engine"]


def migrate(config: Config) -> str:
    """``db upgrade``: check the configured foreign source's schema is there, then apply
    this project's migrations (only its own tables; a foreign schema is never altered).
    Returns the line that says what it did: created the schema, upgraded it from which
    revision, or found it current.

    The foreign schema is checked first, so a ``db upgrade`` run before the app made its
    tables (pg-boss's first ``start()``, Django's ``migrate``) leaves nothing behind."""
    settings = config.settings
    engine = create_engine(settings.database_url,
                           timeouts=DatabaseTimeouts.from_settings(settings))
    try:
        check_source(engine, config)
        found = upgrade(engine)
        shown = display_url(engine.url.render_as_string(hide_password=True))
    finally:
        engine.dispose()
    head = head_revision()
    if found is None:
        return f"created this project's schema (revision {head}) in the database at {shown}"
    if found == head:
        return f"database at {shown} is up to date (revision {head}): nothing to do"
    return f"upgraded the database at {shown} from revision {found} to {head}"


def migration_engine(config: Config | None = None) -> Engine:
    """An engine for ``alembic`` run by hand on the database ``config`` names (else the
    config ``load_config`` reads: ``RECONCILER_CONFIG``, ``RECONCILER_<SETTING>``). A
    migration may rewrite a large table: no statement or lock timeout on it."""
    settings = (config or load_config()).settings
    return create_engine(settings.database_url, timeouts=UNLIMITED_TIMEOUTS)
