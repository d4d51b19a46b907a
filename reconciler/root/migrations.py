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
from reconciler.storage.schema import upgrade

__all__ = ["migrate", "migration_engine"]


def migrate(config: Config) -> str:
    """``db upgrade``: apply this project's migrations (only its own tables; a foreign
    schema is never altered), then check the configured foreign source's schema is
    there. Returns the database, as it may be shown."""
    settings = config.settings
    engine = create_engine(settings.database_url,
                           timeouts=DatabaseTimeouts.from_settings(settings))
    try:
        upgrade(engine)
        check_source(engine, config)
        return display_url(engine.url.render_as_string(hide_password=True))
    finally:
        engine.dispose()


def migration_engine(config: Config | None = None) -> Engine:
    """An engine for ``alembic`` run by hand on the database ``config`` names (else the
    config ``load_config`` reads: ``RECONCILER_CONFIG``, ``RECONCILER_<SETTING>``). A
    migration may rewrite a large table: no statement or lock timeout on it."""
    settings = (config or load_config()).settings
    return create_engine(settings.database_url, timeouts=UNLIMITED_TIMEOUTS)
