"""Settings of the test project: one database named by ``SOURCES_DJANGO_DB`` (a SQLite
file, ``sqlite:///PATH``, a PostgreSQL URL or a ``mysql+pymysql://`` one), the database
task backend."""

from __future__ import annotations

import os
from importlib.util import find_spec
from urllib.parse import urlparse

_url = os.environ.get("SOURCES_DJANGO_DB", "sqlite:///:memory:")

if _url.startswith("sqlite:///"):
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3",
                             "NAME": _url.removeprefix("sqlite:///"),
                             # The reconciler and the worker share the file.
                             "OPTIONS": {"timeout": 30}}}
elif _url.startswith(("mysql", "mariadb")):
    # PyMySQL in place of mysqlclient (Django accepts it: it reports a version above
    # Django's minimum), the driver the reconciler's mysql+pymysql:// URL uses too.
    import pymysql  # type: ignore[import-untyped]

    pymysql.install_as_MySQLdb()
    _parts = urlparse(_url)
    DATABASES = {"default": {"ENGINE": "django.db.backends.mysql",
                             "NAME": _parts.path.lstrip("/"), "USER": _parts.username or "",
                             "PASSWORD": _parts.password or "",
                             "HOST": _parts.hostname or "", "PORT": str(_parts.port or ""),
                             # The tests' server has no TLS (tests/mariadb_server.py).
                             "OPTIONS": {"charset": "utf8mb4",
                                         "ssl_disabled": "ssl_disabled=true" in _parts.query}}}
else:
    _parts = urlparse(_url)
    DATABASES = {"default": {"ENGINE": "django.db.backends.postgresql",
                             "NAME": _parts.path.lstrip("/"), "USER": _parts.username or "",
                             "PASSWORD": _parts.password or "",
                             "HOST": _parts.hostname or "", "PORT": str(_parts.port or "")}}

# Django 6 ships the framework itself; Django 5.2 needs the backport's app (framework.py).
INSTALLED_APPS = [*(() if find_spec("django.tasks") else ("django_tasks",)), "django_tasks_db"]
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
USE_TZ = True
SECRET_KEY = "tests-only"  # noqa: S105 - a throwaway project
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGGING_CONFIG = None
