"""This project's own tables on one engine: every concern's SQL, composed into one store.

Each concern lives in its own module (claims and fenced writes, worker sessions, artifact
records, operator actions, read views, pass units); ``SqlStore`` is all of them on one
SQLAlchemy engine, SQLite or PostgreSQL, and is what the composition root hands to the
worker client, the CLI and the sidecar.
"""

from __future__ import annotations

from sqlalchemy.engine import Engine

from reconciler.storage.artifact_records import ArtifactsSql
from reconciler.storage.claims import ClaimsSql
from reconciler.storage.engines import DEFAULT_TIMEOUTS, DatabaseTimeouts
from reconciler.storage.operator import OperatorSql
from reconciler.storage.pass_store import SourceFactory, SqlPassStore, native_source
from reconciler.storage.read_views import ReadViewsSql
from reconciler.storage.sessions import SessionsSql


class SqlStore(ClaimsSql, SessionsSql, ArtifactsSql, OperatorSql, ReadViewsSql, SqlPassStore):
    """Every operation on this project's tables, on one engine; passes use ``source``
    (``timeouts``: those the engine was created with, see ``SqlPassStore``)."""

    def __init__(self, engine: Engine, source: SourceFactory = native_source, *,
                 timeouts: DatabaseTimeouts = DEFAULT_TIMEOUTS) -> None:
        SqlPassStore.__init__(self, engine, source, timeouts=timeouts)
