"""Which tasks framework the test project runs on: Django 6's own ``django.tasks`` where
Django ships it, else the ``django-tasks`` backport (Django 5.2). django-tasks-db serves
both with the same table, so the project's code differs only in these imports, as a
project moving to Django 6 changes them."""

from __future__ import annotations

from importlib.util import find_spec

BUILTIN = find_spec("django.tasks") is not None
"""True on Django 6+: ``django.tasks`` itself, no backport installed or needed."""

if BUILTIN:
    from django.tasks import TaskContext, default_task_backend, task
else:
    from django_tasks import TaskContext, default_task_backend, task

FRAMEWORK = "django.tasks" if BUILTIN else "django_tasks"
"""The framework's module, as ``manage.py result`` reports which one read a result."""

__all__ = ["BUILTIN", "FRAMEWORK", "TaskContext", "default_task_backend", "task"]
