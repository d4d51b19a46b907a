"""The project's settings: the django-tasks test project's database (``SOURCES_DJANGO_DB``,
the reconciler's own database) with django-celery-results installed instead."""

from __future__ import annotations

from tests.sources.django_app.settings import (  # noqa: F401 - Django reads them by name
    DATABASES,
    DEFAULT_AUTO_FIELD,
    LOGGING_CONFIG,
    SECRET_KEY,
    USE_TZ,
)

INSTALLED_APPS = ["django_celery_results"]
