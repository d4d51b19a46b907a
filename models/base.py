"""Declarative base with the constraint naming convention, the UTC timestamp type, and
what ``alembic check`` compares on each engine."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import DateTime, Dialect, MetaData, String
from sqlalchemy.dialects import mysql
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp with sub-second precision on both engines.

    PostgreSQL stores ``timestamptz`` (microseconds). SQLite has no timestamp type: values
    are stored as fixed-width ``YYYY-MM-DD HH:MM:SS.ffffff`` text in UTC, the same text the
    database clock expression renders, so comparisons in SQL are plain string comparisons.
    SQLite's clock ticks in milliseconds; its values carry ``000`` as the last digits.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> Any:
        # MySQL's DATETIME keeps whole seconds unless asked for six digits; it has no zone,
        # and every session of ours is in UTC (reconciler.storage.mysql).
        if dialect.name == "mysql":
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(self.impl)

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are refused: pass an aware UTC datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name in ("sqlite", "mysql") else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        if not isinstance(value, datetime):
            raise TypeError(f"unexpected timestamp value of type {type(value).__name__}")
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class JobKeyText(TypeDecorator[str]):
    """A job id as its source spells it, stored as text (a pg-boss UUID, a Procrastinate
    integer). Integers bind as their decimal text, so a lookup by an integer id matches
    on both engines; values read back are text."""

    impl = String(200)
    cache_ok = True

    def process_bind_param(self, value: object, dialect: Dialect) -> str | None:
        return None if value is None else str(value)

    def process_result_value(self, value: object, dialect: Dialect) -> str | None:
        return None if value is None else str(value)


class Base(DeclarativeBase):
    """Base of every table; carries the naming convention for constraints and indexes."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UtcDateTime()}


def compared_on(dialect: str) -> Callable[..., bool]:
    """Which objects ``alembic check`` compares on ``dialect`` (Alembic's ``include_object``):
    not a model index created on other engines only (its ``ddl_if``), nor, on MySQL, the
    singleton's generated column and its index (``tables.MYSQL_PROCESSING_SINGLETON``)."""
    def compared(thing: object, name: str | None, _type: str, reflected: bool,
                 _compare_to: object) -> bool:
        if dialect == "mysql" and reflected and name in _MYSQL_ONLY:
            return False
        only = getattr(getattr(thing, "_ddl_if", None), "dialect", None)
        if only is None:
            return True
        return dialect == only if isinstance(only, str) else dialect in only
    return compared


_MYSQL_ONLY = {"processing_singleton_key", "uq_job_runs_processing_singleton"}
