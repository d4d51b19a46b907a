"""Migrations run in-process, and the start-up check that the schema is at head."""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from reconciler.core.vocabulary import DatabaseErrorCode
from reconciler.errors import DatabaseUnavailableError, SchemaOutOfDateError
from reconciler.storage.diagnosis import error_code, error_line
from reconciler.storage.engines import display_url, limit_transaction, read_only

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

UPGRADE_LOCK = 0x5C0A11  # an advisory lock key of our own, held while migrating
_MIGRATING = threading.Lock()
"""Alembic's ``context`` and ``op`` are process-wide proxies: one migration at a time in a
process (two threads migrating two databases would mix their operations)."""
# The newest migration. Checking a database at head then needs no Alembic, whose import
# every CLI call, worker and replica start would otherwise pay (a third of a start-up);
# Alembic is imported where migrations are read or run. A test keeps this equal to the
# scripts' head.
HEAD_REVISION = "0011"


def _script_location() -> Path:
    # A wheel carries the migrations inside the package; a checkout keeps them at the root.
    package = Path(__file__).resolve().parents[1]
    packaged = package / "migrations"
    if (packaged / "env.py").exists():
        return packaged
    return package.parent / "alembic"


def alembic_config() -> Config:
    """An Alembic config pointing at the migrations, with no ini file needed."""
    from alembic.config import Config  # noqa: PLC0415 - see HEAD_REVISION

    config = Config()
    config.set_main_option("script_location", str(_script_location()))
    return config


@functools.cache
def _scripts() -> ScriptDirectory:
    # Read once per process: the migrations of an installation do not change under it,
    # and /readyz must not re-read them on every probe.
    from alembic.script import ScriptDirectory  # noqa: PLC0415 - see HEAD_REVISION

    return ScriptDirectory.from_config(alembic_config())


def scripts_head() -> str | None:
    """The newest migration as the scripts say (what ``HEAD_REVISION`` must equal)."""
    return _scripts().get_current_head()


def head_revision() -> str:
    """The newest migration this code knows."""
    return HEAD_REVISION


@functools.cache
def known_revision(revision: str) -> bool:
    """True when ``revision`` is one of this installation's migrations."""
    from alembic.util.exc import CommandError  # noqa: PLC0415 - see HEAD_REVISION

    try:
        return _scripts().get_revision(revision) is not None
    except CommandError:
        return False


def current_revision(engine: Engine) -> str | None:
    """The database's migration revision, or None for a database without our schema.

    Only a missing ``alembic_version`` table (or an empty one) means "no schema": any other
    failure, a lock or a connection lost at that instant included, is the database being
    unavailable (exit 3), never an old schema (exit 4).
    """
    try:
        with engine.connect() as conn:
            return read_revision(read_only(conn))
    except (OperationalError, DBAPIError) as exc:
        raise unavailable(engine, exc) from None


def read_revision(conn: Connection) -> str | None:
    """``alembic_version`` read directly on ``conn`` (None when the table is absent)."""
    try:
        rows = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    except (OperationalError, DBAPIError) as exc:
        if error_code(exc) is DatabaseErrorCode.SCHEMA_MISMATCH:
            return None
        raise
    return str(rows[0]) if rows else None


def upgrade(engine: Engine, revision: str = "head") -> str | None:
    """Apply migrations on one shared connection (no second engine, no ini file). Returns
    the revision the database was at when this upgrade took its turn (None: it had no
    schema, made now), so ``db upgrade`` can say what it did."""
    from alembic.util.exc import CommandError  # noqa: PLC0415

    from alembic import command  # noqa: PLC0415 - see HEAD_REVISION

    config = alembic_config()
    refuse_newer(current_revision(engine))
    try:
        with engine.begin() as conn:
            # A migration may rewrite a large table or wait for another replica's: it has
            # no statement or lock limit (the connection still has its connect timeout).
            limit_transaction(conn, statement_seconds=None, lock_seconds=None)
            # Replicas started together upgrade one at a time; the others find it done.
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": UPGRADE_LOCK})
            elif conn.dialect.name == "mysql":
                # MySQL's DDL commits as it goes: the lock is the session's, released below;
                # its names are the server's, so the database's name is in it.
                conn.execute(text("SELECT GET_LOCK(CONCAT(:key, DATABASE()), -1)"),
                             {"key": f"{UPGRADE_LOCK}:"})
            config.attributes["connection"] = conn
            # Read under the lock: a replica that upgraded first leaves this one nothing.
            found = (read_revision(conn) if inspect(conn).has_table("alembic_version")
                     else None)
            try:
                with _MIGRATING:
                    command.upgrade(config, revision)
            finally:
                if conn.dialect.name == "mysql":
                    conn.execute(text("DO RELEASE_LOCK(CONCAT(:key, DATABASE()))"),
                                 {"key": f"{UPGRADE_LOCK}:"})
    except (OperationalError, DBAPIError) as exc:
        raise unavailable(engine, exc) from None
    except CommandError as exc:
        # e.g. another release stamped a revision between the check above and now.
        raise SchemaOutOfDateError(f"cannot upgrade the database: {exc}") from None
    return found


def refuse_newer(current: str | None) -> None:
    """A database migrated by a newer release is refused: this code cannot work on it,
    and neither upgrading it (nothing newer here) nor downgrading it (no scripts) can help."""
    if current is not None and not known_revision(current):
        raise SchemaOutOfDateError(
            f"the database schema is at revision {current}, which this version of reconciler "
            f"does not know (its newest is {head_revision()}): a newer release migrated it; "
            "run that release or a later one")


def downgrade(engine: Engine, revision: str = "base") -> None:
    """Undo migrations down to ``revision``."""
    from alembic import command  # noqa: PLC0415 - see HEAD_REVISION

    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        with _MIGRATING:
            command.downgrade(config, revision)


def require_current(engine: Engine) -> None:
    """Refuse to work on a database whose schema is not at this code's head."""
    current, head = current_revision(engine), head_revision()
    if current == head:
        return
    refuse_newer(current)
    if current is None:
        raise SchemaOutOfDateError(
            "the database has no reconciler schema; run `reconciler db upgrade` first")
    raise SchemaOutOfDateError(
        f"the database schema is at revision {current}, this version needs {head}; "
        "run `reconciler db upgrade`")


_NOT_REACHED = (DatabaseErrorCode.UNREACHABLE, DatabaseErrorCode.NO_ANSWER,
                DatabaseErrorCode.AUTHENTICATION_FAILED, DatabaseErrorCode.NO_SUCH_DATABASE)


def unavailable(engine: Engine, exc: Exception) -> DatabaseUnavailableError:
    """The error a command exits 3 with: its line and its code."""
    return DatabaseUnavailableError(describe_connection_error(engine, exc),
                                    code=error_code(exc).value)


def describe_connection_error(engine: Engine, exc: Exception) -> str:
    """One line naming the database (password hidden), what went wrong (a code, unless it
    was never reached) and the driver's first line."""
    url = display_url(engine.url.render_as_string(hide_password=True))
    code = error_code(exc)
    if code in _NOT_REACHED:
        return f"cannot reach the database at {url}: {error_line(exc)}"
    return f"database error ({code.value}) at {url}: {error_line(exc)}"
