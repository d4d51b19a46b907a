"""Settings of the Django project ``reconciler demo --source django-tasks`` runs: one SQLite
file (``DEMO_DJANGO_DB``) and django-tasks-db's database backend."""

from __future__ import annotations

import os

DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3",
                         "NAME": os.environ.get("DEMO_DJANGO_DB", ":memory:"),
                         "OPTIONS": {"timeout": 30}}}
INSTALLED_APPS = ["django_tasks", "django_tasks_db"]
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
USE_TZ = True
SECRET_KEY = "reconciler-demo-only"  # noqa: S105 - a throwaway project
LOGGING_CONFIG = None
