"""The TOML config file (``--config PATH`` or ``RECONCILER_CONFIG``): settings, source, kinds.

Top-level keys are the settings of ``reconciler.settings.Settings``; a flag and an
environment variable still win over the file, and the file wins over the defaults, which
stay declared once, on ``Settings`` (the file's values are fed in as its lowest-priority
source). The tables are ``[source]`` (where jobs are read and changed: DESIGN.md section 9)
and ``[kinds."<glob>"]`` (per-kind rules, resolved by ``reconciler.core.kinds``).

Every problem ends in one ``ConfigError`` line that names the file and the key: an unknown
key or table, a value of the wrong type or out of range, a missing required key.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from reconciler.core.kinds import KIND_KEYS, KindRule, KindRules
from reconciler.core.vocabulary import EffectKind
from reconciler.errors import ConfigError
from reconciler.settings import Settings, describe_validation_error, warn_unknown_variables
from reconciler.source_configs import CeleryConfig, DjangoTasksConfig, celery_config

CONFIG_ENV = "RECONCILER_CONFIG"
"""The environment variable naming the config file when ``--config`` is not given."""

SOURCE_KINDS = ("native", "procrastinate", "graphile-worker", "pg-boss", "table", "django-tasks",
                "celery")

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


# --------------------------------------------------------------------------- #
# [source]
# --------------------------------------------------------------------------- #


@dataclass(frozen=True, slots=True)
class NativeConfig:
    """``kind = "native"``: this project's own ``job_runs`` (the default)."""

    kind: ClassVar[str] = "native"


@dataclass(frozen=True, slots=True)
class ProcrastinateConfig:
    """``kind = "procrastinate"``: Procrastinate's ``procrastinate_jobs`` and workers."""

    kind: ClassVar[str] = "procrastinate"
    schema: str | None = None
    """Where Procrastinate's tables and functions live; None: the connection's search path."""
    session_timeout_seconds: float = 30.0
    """A worker row silent this long is a gone owner (the ``session_timeout_seconds``
    setting; Procrastinate's own default stalled-worker timeout is also 30 s)."""


@dataclass(frozen=True, slots=True)
class GraphileWorkerConfig:
    """``kind = "graphile-worker"``: graphile-worker's ``_private_jobs`` and queues."""

    kind: ClassVar[str] = "graphile-worker"
    schema: str = "graphile_worker"


@dataclass(frozen=True, slots=True)
class PgBossConfig:
    """``kind = "pg-boss"``: pg-boss's partitioned ``job`` table."""

    kind: ClassVar[str] = "pg-boss"
    schema: str = "pgboss"


@dataclass(frozen=True, slots=True)
class TableConfig:
    """``kind = "table"``: a home-grown job table, mapped column by column."""

    kind: ClassVar[str] = "table"
    table: str
    id_column: str
    status_column: str
    processing: str
    queued: str
    failed: str
    schema: str | None = None
    kind_column: str | None = None
    reason_column: str | None = None
    activity_column: str | None = None
    lease_expires_column: str | None = None
    owner_column: str | None = None
    attempts_column: str | None = None
    max_attempts_column: str | None = None
    generation_column: str | None = None
    resume_column: str | None = None
    plan_column: str | None = None
    steps_column: str | None = None

    def mapped_columns(self) -> dict[str, str]:
        """Every mapped column by the key that maps it (``id_column`` -> ``id``...)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name.endswith("_column") and getattr(self, f.name) is not None}


SourceConfig = (NativeConfig | ProcrastinateConfig | GraphileWorkerConfig | PgBossConfig
                | TableConfig | DjangoTasksConfig | CeleryConfig)

_TABLE_REQUIRED = ("table", "id_column", "status_column", "processing", "queued", "failed")
_SOURCE_KEYS: dict[str, tuple[str, ...]] = {
    "native": ("kind",),
    "procrastinate": ("kind", "schema"),
    "graphile-worker": ("kind", "schema"),
    "pg-boss": ("kind", "schema"),
    "table": ("kind", *(f.name for f in fields(TableConfig))),
    "django-tasks": ("kind", "table", "backend_name"),
    "celery": ("kind", "broker_url", "result_table", "result_serializer"),
}


# --------------------------------------------------------------------------- #
# The whole file
# --------------------------------------------------------------------------- #


@dataclass(frozen=True, slots=True)
class Config:
    """Everything the config file, the environment and the flags say, validated."""

    settings: Settings
    source: SourceConfig
    kinds: KindRules
    path: Path | None = None


def load_config(path: str | Path | None = None, **flags: Any) -> Config:
    """Read the config file (``path``, else ``RECONCILER_CONFIG``, else none) and combine it
    with the environment and the flags (``None`` means a flag was not given)."""
    warn_unknown_variables(os.environ)
    chosen = path if path not in (None, "") else os.environ.get(CONFIG_ENV) or None
    where = Path(chosen) if chosen is not None else None
    data = _read(where) if where is not None else {}
    name = str(where) if where is not None else "config"

    file_settings: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("source", "kinds"):
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: {key} must be a table ([{key}]), "
                                  f"not {_type_name(value)}")
        elif key in Settings.model_fields:
            _check_setting_type(name, key, value, Settings.model_fields[key])
            file_settings[key] = value
        elif isinstance(value, dict):
            raise ConfigError(f"{name}: unknown table [{key}] (known: [source], [kinds])")
        else:
            raise ConfigError(f"{name}: unknown key {key!r} (not a setting)")

    # database_url and database_url_file are one setting given two ways: either from a flag
    # or the environment wins over either from the file (not "give one, not both").
    url_keys = ("database_url", "database_url_file")
    if any(flags.get(k) is not None or os.environ.get(f"RECONCILER_{k.upper()}")
           for k in url_keys):
        file_settings = {k: v for k, v in file_settings.items() if k not in url_keys}
    settings = _settings(name, file_settings, flags)
    source = parse_source(data.get("source"), settings, name)
    kinds = parse_kinds(data.get("kinds"), settings, name)
    return Config(settings=settings, source=source, kinds=kinds, path=where)


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def _type_name(value: Any) -> str:
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}.get(
        type(value), type(value).__name__)


def _check_setting_type(name: str, key: str, value: Any, field: FieldInfo) -> None:
    """TOML values are typed: refuse a string or a boolean where a number belongs."""
    expected = field.annotation
    if expected is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        wanted = "a number"
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        wanted = "an integer"
    elif expected is str:
        ok = isinstance(value, str)
        wanted = "a string"
    elif expected is bool:
        ok = isinstance(value, bool)
        wanted = "a boolean"
    else:  # pragma: no cover - every setting is one of the four
        return
    if not ok:
        raise ConfigError(f"{name}: setting {key} must be {wanted}, not {_type_name(value)} "
                          f"(got {value!r})")


# The file's values, for the duration of one ``Settings`` construction.
_FILE_VALUES: ContextVar[Mapping[str, Any] | None] = ContextVar("reconciler_file_settings",
                                                               default=None)


class _FileSettingsSource(PydanticBaseSettingsSource):
    """The config file's top-level keys, consulted after the flags and the environment."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_FILE_VALUES.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_FILE_VALUES.get() or {})


class _SettingsWithFile(Settings):
    """``Settings`` with the config file as its lowest-priority source."""

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, dotenv_settings, file_secret_settings,
                _FileSettingsSource(settings_cls))


@contextmanager
def _file_values(values: Mapping[str, Any]) -> Iterator[None]:
    token = _FILE_VALUES.set(values)
    try:
        yield
    finally:
        _FILE_VALUES.reset(token)


def _settings(name: str, file_settings: dict[str, Any], flags: Mapping[str, Any]) -> Settings:
    given = {key: value for key, value in flags.items() if value is not None}
    try:
        with _file_values(file_settings):
            built = _SettingsWithFile(**given)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, name, file_settings, given)) from None
    # A plain Settings, already validated: callers see the one settings type.
    return Settings.model_construct(_fields_set=built.model_fields_set, **built.model_dump())


def _describe(exc: ValidationError, name: str, file_settings: Mapping[str, Any],
              flags: Mapping[str, Any]) -> str:
    """Name the file when the refused value came from it, else the flag / variable line."""
    error = exc.errors()[0]
    loc = error.get("loc", ())
    key = str(loc[0]) if loc else ""
    from_env = any(k.upper() == f"RECONCILER_{key.upper()}" for k in os.environ)
    if key in file_settings and key not in flags and not from_env:
        message = error.get("msg", "invalid value").removeprefix("Value error, ")
        return (f"{name}: invalid setting {key}: {message} "
                f"(got {error.get('input')!r})")
    line = describe_validation_error(exc)
    return line if key or not file_settings else f"{line} (with settings from {name})"


# --------------------------------------------------------------------------- #
# Parsing [source] and [kinds]
# --------------------------------------------------------------------------- #


def parse_source(table: Mapping[str, Any] | None, settings: Settings,
                 name: str = "config") -> SourceConfig:
    """The ``[source]`` table as its kind's config; none at all means ``native``."""
    if table is None:
        return NativeConfig()
    if "kind" not in table:
        raise ConfigError(f"{name}: [source] needs kind = one of {', '.join(SOURCE_KINDS)}")
    kind = table["kind"]
    if kind not in SOURCE_KINDS:
        raise ConfigError(f"{name}: [source] kind must be one of {', '.join(SOURCE_KINDS)} "
                          f"(got {kind!r})")
    allowed = _SOURCE_KEYS[kind]
    for key, value in table.items():
        if key not in allowed:
            raise ConfigError(f"{name}: [source] unknown key {key!r} for kind {kind!r} "
                              f"(known: {', '.join(allowed)})")
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{name}: [source] {key} must be a non-empty string, "
                              f"not {_type_name(value)} (got {value!r})")
    values = {k: v for k, v in table.items() if k != "kind"}
    for key, value in values.items():
        names_sql = key in {"schema", "table", "result_table"} or key.endswith("_column")
        if names_sql and not _IDENTIFIER.match(value):
            raise ConfigError(f"{name}: [source] {key} must be a plain SQL name (letters, "
                              f"digits, '_', at most 63; got {value!r})")
    if kind == "native":
        return NativeConfig()
    if kind == "procrastinate":
        return ProcrastinateConfig(schema=values.get("schema"),
                                   session_timeout_seconds=settings.session_timeout_seconds)
    if kind == "celery":
        return celery_config(values, settings, name)
    if kind == "table":
        return _table_config(values, name)
    plain: dict[str, type[GraphileWorkerConfig | PgBossConfig | DjangoTasksConfig]] = {
        "graphile-worker": GraphileWorkerConfig, "pg-boss": PgBossConfig,
        "django-tasks": DjangoTasksConfig}
    return plain[kind](**values)


def _table_config(values: dict[str, Any], name: str) -> TableConfig:
    for key in _TABLE_REQUIRED:
        if key not in values:
            raise ConfigError(f"{name}: [source] kind 'table' needs {key}")
    config = TableConfig(**values)
    if config.processing in (config.queued, config.failed):
        raise ConfigError(f"{name}: [source] processing ({config.processing!r}) must differ "
                          "from queued and failed")
    if (config.plan_column is None) != (config.steps_column is None):
        raise ConfigError(f"{name}: [source] plan_column and steps_column are mapped together "
                          "(a plan without step results would rerun finished steps)")
    if config.resume_column is not None and config.plan_column is None:
        raise ConfigError(f"{name}: [source] resume_column needs plan_column and steps_column")
    seen: dict[str, str] = {}
    for key, column in config.mapped_columns().items():
        if column in seen:
            raise ConfigError(f"{name}: [source] {key} and {seen[column]} both map "
                              f"column {column!r}")
        seen[column] = key
    return config


_KIND_NUMBERS: dict[str, tuple[type, float, bool]] = {
    # key: (type, bound, bound allowed)
    "stale_after_seconds": (float, 0.0, True),
    "wedged_after_seconds": (float, 0.0, False),
    "max_run_seconds": (float, 0.0, False),
    "max_attempts": (int, 1.0, True),
    "crash_loop_after": (int, 1.0, True),
}


def parse_kinds(tables: Mapping[str, Any] | None, settings: Settings,
                name: str = "config") -> KindRules:
    """The ``[kinds."<glob>"]`` tables, over the settings' thresholds and attempt budget."""
    rules = []
    for pattern, table in (tables or {}).items():
        where = f'[kinds."{pattern}"]'
        if not isinstance(table, dict):
            raise ConfigError(f"{name}: kinds.{pattern} must be a table ({where}), "
                              f"not {_type_name(table)}")
        values: dict[str, Any] = {}
        for key, value in table.items():
            if key not in KIND_KEYS:
                hint = (f' (quote patterns with dots: [kinds."{pattern}.{key}"])'
                        if isinstance(value, dict) else f" (known: {', '.join(KIND_KEYS)})")
                raise ConfigError(f"{name}: {where} unknown key {key!r}{hint}")
            values[key] = _kind_value(name, where, key, value)
        rules.append(KindRule(pattern, **values))
    try:
        kinds = KindRules(rules, stale_after_seconds=settings.stale_after_seconds,
                          wedged_after_seconds=settings.wedged_after_seconds,
                          max_attempts=settings.default_max_attempts,
                          crash_loop_after=settings.crash_loop_after)
    except ValueError as exc:  # pragma: no cover - TOML keys are unique already
        raise ConfigError(f"{name}: [kinds] {exc}") from None
    problems = kinds.problems()
    if problems:
        raise ConfigError(f"{name}: {problems[0]}")
    return kinds


def _kind_value(name: str, where: str, key: str, value: Any) -> Any:
    if key == "effect":
        kinds = ", ".join(k.value for k in EffectKind)
        if not isinstance(value, str) or value not in {k.value for k in EffectKind}:
            raise ConfigError(f"{name}: {where} effect must be one of {kinds} (got {value!r})")
        return EffectKind(value)
    if key == "reconcile":
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: {where} reconcile must be true or false "
                              f"(got {value!r})")
        return value
    kind, bound, inclusive = _KIND_NUMBERS[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            kind is int and not isinstance(value, int)):
        wanted = "an integer" if kind is int else "a number"
        raise ConfigError(f"{name}: {where} {key} must be {wanted}, not {_type_name(value)} "
                          f"(got {value!r})")
    if value < bound or (value == bound and not inclusive):
        relation = ">=" if inclusive else ">"
        raise ConfigError(f"{name}: {where} {key} must be {relation} {bound:g} (got {value!r})")
    return kind(value)
