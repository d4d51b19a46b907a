"""Django's tasks (``django_tasks`` database backend) as a job source.

Its shape, fences and writes are in ``source``;
what every source shares is in ``reconciler.sources.kit``."""

from __future__ import annotations

from reconciler.sources.django_tasks.source import (
    EXCEPTION_CLASS_PATH,
    DjangoTasksConfig,
    DjangoTasksSource,
)

__all__ = ["EXCEPTION_CLASS_PATH", "DjangoTasksConfig", "DjangoTasksSource"]
