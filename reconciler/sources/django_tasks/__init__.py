"""Django's tasks (``django_tasks`` database backend) as a job source: its declaration
(``source.DECLARATION``: shape, fences and writes); what every source shares is in
``reconciler.sources.kit``."""

from __future__ import annotations

from reconciler.sources.django_tasks.source import (
    DECLARATION,
    EXCEPTION_CLASS_PATH,
    DjangoTasksConfig,
)

__all__ = ["DECLARATION", "EXCEPTION_CLASS_PATH", "DjangoTasksConfig"]
