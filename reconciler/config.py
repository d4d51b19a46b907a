"""The one way settings, ``[source]`` and ``[kinds]`` are read: ``load_config``.

The config file (``--config PATH`` or ``RECONCILER_CONFIG``) is TOML. Its top-level keys
are the settings of ``reconciler.settings.Settings``; a flag and an environment variable
still win over the file, and the file wins over the defaults, which stay declared once, on
``Settings`` (the file's values are fed in as its lowest-priority source). Its tables are
``[source]`` (where jobs are read and changed; each kind's keys are its config model in
``reconciler.sources.registry``) and ``[kinds."<glob>"]`` (per-kind rules, each a
``KindSettings``, resolved by ``reconciler.core.kinds``). Every model is pydantic, bounded
as its setting is.

Every problem ends in one ``ConfigError`` line that names the file and the key: a file
that is not UTF-8 TOML, an unknown key or table, a value of the wrong type or out of range
(nan and infinities included), a missing required key.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from reconciler.core.kinds import KindRules
from reconciler.errors import ConfigError
from reconciler.settings import (
    KindSettings,
    Settings,
    SourceSettings,
    describe_table_error,
    describe_validation_error,
    type_name,
    warn_unknown_variables,
)
from reconciler.sources.registry import (
    SOURCES,
    GraphileWorkerConfig,
    NativeConfig,
    PgBossConfig,
    ProcrastinateConfig,
    SourceEntry,
    TableConfig,
    entry_of,
)

__all__ = [
    "CONFIG_ENV", "Config", "ConfigError", "GraphileWorkerConfig", "NativeConfig",
    "PgBossConfig", "ProcrastinateConfig", "SourceConfig", "TableConfig", "load_config",
    "parse_kinds", "parse_source",
]

CONFIG_ENV = "RECONCILER_CONFIG"
"""The environment variable naming the config file when ``--config`` is not given."""

SourceConfig = SourceSettings
"""Any source's ``[source]`` config (the registry's entry says which kind)."""

_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class Config:
    """Everything the config file, the environment and the flags say, validated."""

    settings: Settings
    kinds: KindRules
    source: SourceSettings = field(default_factory=NativeConfig)
    """The configured source; the native one unless ``[source]`` names another."""
    path: Path | None = None

    @property
    def source_entry(self) -> SourceEntry:
        """The registry's entry of the configured source."""
        return entry_of(self.source)


def load_config(path: str | Path | None = None, **flags: Any) -> Config:
    """Read the config file (``path``, else ``RECONCILER_CONFIG``, else none) and combine it
    with the environment and the flags (``None`` means a flag was not given)."""
    warn_unknown_variables(os.environ)
    if path is not None and not str(path).strip():
        raise ConfigError("--config names no file (an empty path); leave it out to use "
                          f"{CONFIG_ENV} or no file")
    chosen = path if path is not None else os.environ.get(CONFIG_ENV) or None
    where = Path(chosen) if chosen is not None else None
    data = _read(where) if where is not None else {}
    name = str(where) if where is not None else "config"

    file_settings: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("source", "kinds"):
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: {key} must be a table ([{key}]), "
                                  f"not {type_name(value)}")
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
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    if raw.startswith(_BOM):
        raise ConfigError(f"{path}: starts with a byte order mark (BOM), which TOML does "
                          "not allow; save it as UTF-8 without one")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start + 1} is "
                          f"0x{raw[exc.start]:02x}); TOML files are UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


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
        raise ConfigError(f"{name}: setting {key} must be {wanted}, not {type_name(value)} "
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
                 name: str = "config") -> SourceSettings:
    """The ``[source]`` table as its kind's config model; none at all means ``native``."""
    if table is None:
        return NativeConfig()
    known = ", ".join(SOURCES)
    if "kind" not in table:
        raise ConfigError(f"{name}: [source] needs kind = one of {known}")
    kind = table["kind"]
    if not isinstance(kind, str) or kind not in SOURCES:
        raise ConfigError(f"{name}: [source] kind must be one of {known} (got {kind!r})")
    model = SOURCES[kind].config
    allowed = model.file_keys()
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{name}: [source] unknown key {key!r} for kind {kind!r} "
                              f"(known: {', '.join(allowed)})")
    values = {key: value for key, value in table.items() if key != "kind"}
    values.update({key: getattr(settings, key) for key in model.from_settings})
    try:
        return model(**values)
    except ValidationError as exc:
        raise ConfigError(f"{name}: " + describe_table_error(
            exc, f"[source] kind {kind!r}:")) from None


def parse_kinds(tables: Mapping[str, Any] | None, settings: Settings,
                name: str = "config") -> KindRules:
    """The ``[kinds."<glob>"]`` tables, over the settings' thresholds and attempt budget."""
    rules = []
    for pattern, table in (tables or {}).items():
        where = f'[kinds."{pattern}"]'
        if not pattern:
            raise ConfigError(f'{name}: [kinds.""]: a kind pattern cannot be empty '
                              '(use "*" for every kind)')
        if not isinstance(table, dict):
            raise ConfigError(f"{name}: kinds.{pattern} must be a table ({where}), "
                              f"not {type_name(table)}")
        for key, value in table.items():
            if key not in KindSettings.model_fields:
                hint = (f' (quote patterns with dots: [kinds."{pattern}.{key}"])'
                        if isinstance(value, dict)
                        else f" (known: {', '.join(KindSettings.model_fields)})")
                raise ConfigError(f"{name}: {where} unknown key {key!r}{hint}")
        try:
            rules.append(KindSettings(**table).rule(pattern))
        except ValidationError as exc:
            raise ConfigError(f"{name}: " + describe_table_error(exc, where)) from None
    kinds = KindRules(rules, stale_after_seconds=settings.stale_after_seconds,
                      wedged_after_seconds=settings.wedged_after_seconds,
                      max_attempts=settings.default_max_attempts,
                      crash_loop_after=settings.crash_loop_after)
    problems = kinds.problems()
    if problems:
        raise ConfigError(f"{name}: {problems[0]}")
    return kinds
