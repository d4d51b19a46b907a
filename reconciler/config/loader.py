"""The one way settings, ``[source]`` and ``[kinds]`` are read: ``load_config``.

The config file (``--config PATH`` or ``RECONCILER_CONFIG``) is TOML. Its top-level keys
are the settings (``reconciler.config.settings.Settings``); a flag and an environment
variable still win over the file, and the file wins over the defaults, which stay declared
once, in ``reconciler.config.fields`` (the file's values are fed in as the settings' lowest
priority source). Its tables are ``[source]`` (where jobs are read and changed; each
kind's config model is named by its entry in ``reconciler.config.registry``, the model
declared by its source module and imported only when that kind is configured) and
``[kinds."<glob>"]`` (per-kind rules, each a ``KindSettings``, resolved by
``reconciler.core.kinds``). Every model is pydantic, bounded as its setting is.

Every problem ends in one ``ConfigError`` line that names the file and the key: a file
that is not UTF-8 TOML, an unknown key or table, a value of the wrong type or out of range
(nan and infinities included), a missing required key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from reconciler.config.registry import SOURCES, SourceEntry, entry_of
from reconciler.config.settings import Settings, load_settings, type_name
from reconciler.config.tables import (
    KindSettings,
    NativeConfig,
    SourceSettings,
    describe_table_error,
    did_you_mean,
)
from reconciler.core.kinds import KindRules
from reconciler.core.passes import PassConfig
from reconciler.errors import ConfigError

__all__ = ["CONFIG_ENV", "Config", "ConfigError", "SourceConfig", "config_from", "load_config",
           "parse_kinds", "parse_source", "pass_config"]

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

    def pass_config(self, instance: str) -> PassConfig:
        """The pass configuration of this config for ``instance``."""
        return pass_config(self.settings, instance, self.kinds)


def pass_config(settings: Settings, instance: str, kinds: KindRules | None = None
                ) -> PassConfig:
    """The pass configuration these settings (and ``[kinds]``) give an instance.

    With ``[kinds]``, the scan's thresholds are the defaults with the shortest wedged time
    any kind has (so a kind wedged sooner is found) and each job is decided under its own
    kind's thresholds.
    """
    return PassConfig(
        batch_size=settings.batch_size,
        thresholds=settings.thresholds() if kinds is None else kinds.scan_thresholds(),
        instance=instance,
        session_timeout_seconds=settings.session_timeout_seconds,
        shadow=settings.shadow,
        brake=settings.brake_limits(),
        kinds=kinds,
    )


def load_config(path: str | Path | None = None, **flags: Any) -> Config:
    """Read the config file (``path``, else ``RECONCILER_CONFIG``, else none) and combine it
    with the environment and the flags (``None`` means a flag was not given)."""
    if path is not None and not str(path).strip():
        raise ConfigError("--config names no file (an empty path); leave it out to use "
                          f"{CONFIG_ENV} or no file")
    chosen = path if path is not None else os.environ.get(CONFIG_ENV) or None
    where = Path(chosen) if chosen is not None else None
    data = _read(where) if where is not None else {}
    return config_from(data, str(where) if where is not None else "config", where, **flags)


def config_from(data: Mapping[str, Any], name: str = "config", path: Path | None = None,
                **flags: Any) -> Config:
    """A config file's content (``data``, as TOML reads it; ``name`` in errors) combined
    with the environment and the flags: ``load_config`` once the file is read, and how a
    demo builds its config from tables it declares."""
    file_settings: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("source", "kinds"):
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: {key} must be a table ([{key}]), "
                                  f"not {type_name(value)}")
        elif key in Settings.model_fields:
            file_settings[key] = value
        elif isinstance(value, dict):
            raise ConfigError(f"{name}: unknown table [{key}] (known: [source], [kinds])")
        else:
            raise ConfigError(f"{name}: unknown key {key!r} (not a setting"
                              f"{did_you_mean(key, Settings.model_fields)})")

    settings = load_settings(file_values=file_settings, file_name=name, **flags)
    source = parse_source(data.get("source"), settings, name)
    kinds = parse_kinds(data.get("kinds"), settings, name)
    return Config(settings=settings, source=source, kinds=kinds, path=path)


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
    # Imported with a file to read: a command given none does not pay for the parser.
    import tomllib  # noqa: PLC0415

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


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
    # Only the configured kind's module is imported: its config model says its keys.
    model = SOURCES[kind].config_model()
    allowed = model.file_keys()
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{name}: [source] unknown key {key!r} for kind {kind!r} "
                              f"(known: {', '.join(allowed)}{did_you_mean(key, allowed)})")
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
                        else f" (known: {', '.join(KindSettings.model_fields)}"
                             f"{did_you_mean(key, KindSettings.model_fields)})")
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
