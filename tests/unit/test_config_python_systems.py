"""``[source]`` for Django tasks and Celery: defaults, and one line for each bad config."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from reconciler.config.loader import load_config
from reconciler.errors import ConfigError
from reconciler.root.checks import open_foreign_source
from reconciler.sources.celery import CeleryConfig
from reconciler.sources.django_tasks import DjangoTasksConfig


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RECONCILER_CONFIG", "RECONCILER_DATABASE_URL",
                 "RECONCILER_SESSION_TIMEOUT_SECONDS"):
        monkeypatch.delenv(name, raising=False)


def load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "reconciler.toml"
    path.write_text(textwrap.dedent(text))
    return load_config(path).source


def refused(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_django_tasks_defaults(tmp_path: Path) -> None:
    """The backend's own table, every backend's rows."""
    assert load(tmp_path, '[source]\nkind = "django-tasks"\n') == DjangoTasksConfig(
        table="django_tasks_database_dbtaskresult", backend_name=None)


def test_django_tasks_backend_name(tmp_path: Path) -> None:
    source = load(tmp_path, '[source]\nkind = "django-tasks"\nbackend_name = "default"\n')
    assert source == DjangoTasksConfig(backend_name="default")


def test_celery_takes_the_session_timeout_setting(tmp_path: Path) -> None:
    source = load(tmp_path, 'session_timeout_seconds = 45\n[source]\nkind = "celery"\n'
                            'broker_url = "redis://r:6379/0"\n')
    assert source == CeleryConfig(broker_url="redis://r:6379/0", session_timeout_seconds=45.0)


def test_celery_over_django_celery_results_with_its_routes(tmp_path: Path) -> None:
    """django-celery-results keeps no queue: the app's routes say where a task goes."""
    source = load(tmp_path, '[source]\nkind = "celery"\nbroker_url = "redis://r"\n'
                            'result_table = "django_celery_results_taskresult"\n'
                            'task_default_queue = "default"\n'
                            '[source.task_routes]\n"billing.*" = "billing"\n')
    assert source == CeleryConfig(broker_url="redis://r",
                                  result_table="django_celery_results_taskresult",
                                  task_default_queue="default",
                                  task_routes={"billing.*": "billing"})


@pytest.mark.parametrize(("text", "names"), [
    ('[source]\nkind = "celery"\n', ["broker_url", "celery"]),
    ('[source]\nkind = "celery"\nbroker_url = "amqp://guest@rabbit//"\n',
     ["broker_url", "Redis", "amqp:"]),
    ('[source]\nkind = "celery"\nbroker_url = "redis://r"\nresult_serializer = "pickle"\n',
     ["result_serializer", "json", "pickle"]),
    ('[source]\nkind = "celery"\nbroker_url = "redis://r"\nresult_table = "a b"\n',
     ["result_table", "plain SQL name"]),
    ('[source]\nkind = "celery"\nbroker_url = "redis://r"\ntask_routes = "q"\n',
     ["task_routes", "table of non-empty strings"]),
    ('[source]\nkind = "celery"\nbroker_url = "redis://r"\ntask_routes = {"a.*" = 1}\n',
     ["task_routes", "non-empty string"]),
    ('[source]\nkind = "django-tasks"\nschema = "x"\n', ["schema", "django-tasks"]),
    ('[source]\nkind = "django-tasks"\ntable = "x;y"\n', ["table", "plain SQL name"]),
    ('[source]\nkind = "django-tasks"\nbackend_name = 3\n', ["backend_name", "an integer"]),
])
def test_refused_in_one_line(tmp_path: Path, text: str, names: list[str]) -> None:
    message = refused(tmp_path, text)
    for name in names:
        assert name in message


@pytest.mark.parametrize(("text", "expected"), [
    ('kind = "django-tasks"', "django-tasks"),
    ('kind = "celery"\nbroker_url = "redis://r:6379/0"', "celery"),
])
def test_kind_to_class(tmp_path: Path, text: str, expected: str) -> None:
    """Built without touching a database or the broker."""
    config = load_config(_write(tmp_path, f"[source]\n{text}\n"))
    source = open_foreign_source(None, config.source, config.kinds)  # type: ignore[arg-type]
    assert source.source_name == expected


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "reconciler.toml"
    path.write_text(text)
    return path
