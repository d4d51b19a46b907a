"""The ``[source]`` configs of the Python job systems: Django's tasks framework and Celery.

Parsed by ``reconciler.config`` (which checks every key is known and a non-empty string);
what each system needs beyond that is checked here, in one line naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from reconciler.errors import ConfigError
from reconciler.settings import Settings


@dataclass(frozen=True, slots=True)
class DjangoTasksConfig:
    """``kind = "django-tasks"``: Django's tasks framework, database backend (django-tasks-db)."""

    kind: ClassVar[str] = "django-tasks"
    table: str = "django_tasks_database_dbtaskresult"
    backend_name: str | None = None
    """Only rows of this backend alias; None: every backend's rows."""


@dataclass(frozen=True, slots=True)
class CeleryConfig:
    """``kind = "celery"``: Celery's database result backend, liveness over its broker."""

    kind: ClassVar[str] = "celery"
    broker_url: str
    result_table: str = "celery_taskmeta"
    """``celery_taskmeta`` (Celery's own) or ``django_celery_results_taskresult``."""
    result_serializer: str = "json"
    session_timeout_seconds: float = 30.0
    """A worker silent to ping this long, across passes, is gone (the
    ``session_timeout_seconds`` setting)."""


def celery_config(values: dict[str, Any], settings: Settings, name: str) -> CeleryConfig:
    """``[source] kind = "celery"``: its broker is required, its serializer one we read."""
    if "broker_url" not in values:
        raise ConfigError(f"{name}: [source] kind 'celery' needs broker_url (the app's broker: "
                          "liveness is its workers' answer to ping)")
    if not values["broker_url"].startswith(REDIS_SCHEMES):
        raise ConfigError(f"{name}: [source] broker_url must be a Redis URL (redis://...): "
                          "only Redis lets the reconciler see and take back a message the "
                          f"broker would run again (got {values['broker_url'].split(':')[0]}:)")
    if values.get("result_serializer", "json") not in CELERY_SERIALIZERS:
        raise ConfigError(f"{name}: [source] result_serializer must be one of "
                          f"{', '.join(CELERY_SERIALIZERS)} (got {values['result_serializer']!r})")
    return CeleryConfig(**values, session_timeout_seconds=settings.session_timeout_seconds)


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
"""The brokers the celery source supports: Redis (see docs/sources.md, Celery)."""

CELERY_SERIALIZERS = ("json",)
"""The result serializers whose rows the celery source reads (args, kwargs, result): never
pickle, which would run code chosen by whoever can write the result table."""
